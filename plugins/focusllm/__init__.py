"""focusllm: parallel chunk decoding into candidate tokens (FocusLLM, Li et al. 2024).  See method.py."""

from lcx.plugins.focusllm.method import (LOSSES, RECALL_CUE, CandidateLayer, ChunkGroup, ChunkMemo, FocusLLM, TrainDraw,
                                         candidate_kv, candidate_positions, candidate_topk_mask, chunk_spans,
                                         fresh_candidates, lcx_register_methods, refresh_candidates, to_slots, topk_keep)

__all__ = ["LOSSES", "RECALL_CUE", "CandidateLayer", "ChunkGroup", "ChunkMemo", "FocusLLM", "TrainDraw", "candidate_kv",
           "candidate_positions", "candidate_topk_mask", "chunk_spans", "fresh_candidates", "lcx_register_methods",
           "refresh_candidates", "to_slots", "topk_keep"]
