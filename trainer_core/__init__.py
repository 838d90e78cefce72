"""The training engine. Imports no web, database or queue library; run by hand with
`python -m trainer_core.launch spec.json`. Modules `spec`, `rows` and `registry` import no torch either,
so the API can validate jobs and files without loading a training stack."""
