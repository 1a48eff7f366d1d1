"""`lcx serve` on SmolLM2-135M, for real (vLLM on CPU): same tokens as lcx's Hugging Face path, several LoRA
adapters at once, concurrent requests kept apart, bad requests answered with 4xx.

One module per server, each engine started once in its module and stopped when the module's tests end: the
model with YaRN x4 (`rope`) and two q/k LoRA adapters (test_lora), the model behind `vanilla`'s truncating
middleware (test_vanilla), `streaming`, `fot` (with a document memory and a LoRA adapter) and `focusllm`
inside vLLM's attention (test_streaming, test_fot, test_focusllm), and plain `vllm serve` with the plugin
(test_plain).  The model is SmolLM2-135M's weights under a 2,048-token window (harness.model_path), so a parity
past the window is a 2.5K-token generation (test_lora's: 3K) on both sides; the servers are few (each start
costs more than its requests), and the prompts that check isolation are short.
"""
