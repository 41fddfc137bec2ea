"""Code generation: the compact physical layout of each microbatch and its torch.fx programs."""

from harts.codegen.layout import MicrobatchLayout

__all__ = ["MicrobatchLayout"]
