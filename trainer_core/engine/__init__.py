"""Running a job: `launch` (the recipe: set up, train, save, clean up), the Trainer and its callbacks, which
backend and precision run and why, ranks under torchrun, and ONNX Runtime training's setup and patches."""
