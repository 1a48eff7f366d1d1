"""``python -m lcx.integrations.vllm serve MODEL ...``: vLLM's own command line (``vllm serve MODEL ...``)."""

import sys

from lcx.integrations.vllm.server import vllm_cli

vllm_cli(sys.argv[1:])
