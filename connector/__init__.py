"""Transport and vLLM integration for tritonkv (no vLLM import here; see ``vllm_connector``)."""
