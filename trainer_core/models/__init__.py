"""Base models: the registry of what this deployment can fine-tune (torch-free), and loading or building
them, tiny built models and their tokenizers included, in `modeling`."""
