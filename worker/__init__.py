"""Execution: Celery tasks that run jobs as trainer_core subprocesses and relay what they report."""
