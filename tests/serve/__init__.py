"""`lcx serve` on SmolLM2-135M, for real (vLLM on CPU): same tokens as lcx's Hugging Face path, several LoRA
adapters at once, concurrent requests kept apart, bad requests answered with 4xx.

One module per server, each engine started once in its module and stopped when the module's tests end: the
model with YaRN x4 (`rope`) and two q/k LoRA adapters (test_lora), the model behind `vanilla`'s truncating
middleware (test_vanilla), `streaming`, `fot` (with a document memory and a LoRA adapter) and `focusllm`
inside vLLM's attention (test_streaming, test_fot, test_focusllm), and plain `vllm serve` with the plugin
(test_plain).  Each parity past the window costs a 10K-token generation (test_lora's and test_focusllm's:
12K) on both sides (~0.5-1.5 min each on 2 cores): the servers are few, and the prompts that check isolation
are short.
"""
