"""Routed SwiGLU experts: ``naive`` per-expert reference, ``grouped`` grouped-GEMM path."""
