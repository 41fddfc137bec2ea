"""TreeView: the execution view of a compiled microbatch (§3.4, §4.2).

The hidden tensor of a layer holds the microbatch's C compact rows in the layout's
physical order (round, then sequence, then position). Token-wise work runs once per row;
the three sequence operators run the torch.fx programs generated from the layout
(:mod:`harts.codegen.fx`), with this layer's tensors:

* linear attention: one packed chunkwise call per round; replay rows are gathered from
  ancestors' existing rows, initial states are zero or boundary states exported by an
  earlier round (in the autograd graph, so their gradients reach the producing call);
* causal convolution: each sequence is preceded by its true ancestors' last ``w - 1`` rows;
* attention: each sequence's queries against its gathered ancestor + own keys/values,
  bottom-right causal.

Gathers are :class:`~harts.kernels.rows.packed.RowGather` modules: when several sequences read
one row, backward sums their gradients into it, and a row read once gets its gradient by a
copy. ``row_weight`` is each row's multiplicity q.
"""

from __future__ import annotations


import torch

from harts.errors import ModelInputError
from harts.ir.layout import MicrobatchLayout
from harts.runtime.programs import RUNTIME_CACHE, LayoutCache
from harts.kernels.interface import Kernels

__all__ = ["TreeView"]


class TreeView:
    """Execution view over one microbatch's compact layout.

    Args:
        layout: the microbatch's :class:`~harts.codegen.layout.MicrobatchLayout`.
        device: where index tensors and programs live.
        kernels: module with ``chunk_linear_attention``, ``causal_conv1d`` and ``attention``
            (default: the kernel dispatch of :mod:`harts.kernels`).
        programs: where the generated programs are cached (default: the process-wide cache,
            shared by every view of the same layout).
    """

    def __init__(
        self,
        layout: MicrobatchLayout,
        device: torch.device | str | None = None,
        *,
        kernels: Kernels | None = None,
        programs: LayoutCache = RUNTIME_CACHE,
    ):
        self.layout = layout
        # B of every linear-attention call: the plan's (replay anchors and exported states sit on its chunk grid)
        self.chunk_size = layout.chunk_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.kernels = kernels
        self.programs = programs
        self.num_rows = layout.num_rows
        # copied to the device once per layout (shared by every view and pass of it), not per view
        self.positions = programs.tensor(layout, "row_position", lambda: layout.row_position, self.device, torch.long)
        self.row_weight = programs.tensor(layout, "row_multiplicity", lambda: layout.row_multiplicity, self.device,
                                          torch.get_default_dtype())

    def __repr__(self) -> str:
        layout = self.layout
        return (
            f"TreeView(microbatch={layout.microbatch}, rows={layout.num_rows}, sequences={layout.num_sequences}, "
            f"rounds={layout.num_rounds}, chunk_size={self.chunk_size})"
        )

    def program(self, kind: str, **options) -> torch.fx.GraphModule:
        """The generated program of one operator kind (see :func:`harts.codegen.fx.build_program`)."""
        return self.programs.program(self.layout, kind, self.device, self.kernels, **options)

    def input_ids(self, tokens) -> torch.Tensor:
        """[C] token ids of the rows, from the batch's per-trajectory token arrays."""
        return torch.as_tensor(self.layout.input_ids(tokens), dtype=torch.long).to(self.device)

    def causal_conv(self, x, weight, bias, activation):
        self._check_rows(x, "causal_conv x")
        return self.program("conv", width=int(weight.shape[-1]))(x, weight, bias, activation)

    def linear_attention(self, q, k, v, log_decay, beta, *, scale):
        self._check_rows(q, "linear_attention q")
        return self.program("linear_attention")(q, k, v, log_decay, beta, scale)

    def attention(self, q, k, v, *, scale):
        self._check_rows(q, "attention q")
        return self.program("attention")(q, k, v, scale)

    def _check_rows(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.shape[0] != self.num_rows:
            raise ModelInputError(f"TreeView of microbatch {self.layout.microbatch}: {what} has {tensor.shape[0]} rows, expected {self.num_rows}")

