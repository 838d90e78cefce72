"""Inference from jobs' ONNX artifacts with ONNX Runtime (`ortune serve`): reached by the API over HTTP."""
