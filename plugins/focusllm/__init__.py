"""focusllm: parallel chunk decoding into candidate tokens (FocusLLM, Li et al. 2024).  See method.py."""

from lcx.hookspecs import hookimpl
from lcx.plugins.focusllm.attention import candidate_topk_mask, topk_keep
from lcx.plugins.focusllm.cache import CandidateLayer
from lcx.plugins.focusllm.candidates import (ChunkGroup, ChunkMemo, candidate_kv, candidate_positions, chunk_spans,
                                             fresh_candidates, refresh_candidates, to_slots)
from lcx.plugins.focusllm.method import FocusLLM
from lcx.plugins.focusllm.training import LOSSES, RECALL_CUE, CandidateTraining, TrainDraw

__all__ = ["LOSSES", "RECALL_CUE", "CandidateLayer", "CandidateTraining", "ChunkGroup", "ChunkMemo", "FocusLLM",
           "TrainDraw", "candidate_kv", "candidate_positions", "candidate_topk_mask", "chunk_spans",
           "fresh_candidates", "refresh_candidates", "to_slots", "topk_keep"]


@hookimpl
def lcx_register_methods(register):
    register(FocusLLM)
