"""The training engine. Imports no web, database or queue library; run by hand with
`python -m trainer_core.engine.launch spec.json`.

    spec, contract, events   the job's spec, and what the worker and the trainer process say to each other
    tasks/                   the task registry (torch-free) and each task's recipe module
    methods/                 the method registry (torch-free) and each method's module
    data/                    rows and upload checks, media archives, the stores, batching
    models/                  the base-model registry (torch-free) and loading or building models
    engine/                  launch's recipe, the Trainer, backend and precision choice, ranks, ORT training
    export/                  the exporter contract (save, ONNX, parity, manifest) and one module per family

`spec`, `tasks`, `methods`, `data.rows` and `models.registry` import no torch, so the API can validate jobs
and files without loading a training stack."""
