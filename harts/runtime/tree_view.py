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

The linear-attention layers run on the compact rows, each round packing its own q, k, v, decay and beta.
With :attr:`TreeView.pack_linear_rows` they run on packed rows when the layout has replay
(:meth:`TreeView.linear_rows`, :func:`harts.codegen.fx.linear_rows`): the layer's hidden rows are gathered
into round order once, its projections, convolution and rounds run there (:class:`PackedRowsView`), and
its output rows are taken back at each compact row's own position. That moves fewer bytes but measured
slower on the headline (an H200: 2.215 s a pass against 2.169 s, ``harts-bench --packed-linear-rows``),
so it is not the default.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.codegen.fx import linear_rows
from harts.errors import ModelInputError
from harts.ir.layout import MicrobatchLayout
from harts.kernels.rows.packed import RowGather, RowScatter
from harts.runtime.programs import RUNTIME_CACHE, LayoutCache, on_device
from harts.runtime.view import LinearRows, SameRows
from harts.kernels.interface import Kernels

__all__ = ["PackedRowsView", "TreeView"]


class _LayoutPrograms:
    """The sequence operators of a view that runs its layout's generated programs (``programs`` cache,
    ``layout``, ``device``, ``kernels``, ``num_rows``); subclasses name the program kinds they run."""

    conv_kind = "conv"
    linear_attention_kind = "linear_attention"

    def program(self, kind: str, **options) -> torch.fx.GraphModule:
        """The generated program of one operator kind (see :func:`harts.codegen.fx.build_program`)."""
        return self.programs.program(self.layout, kind, self.device, self.kernels, **options)

    def causal_conv(self, x, weight, bias, activation):
        self._check_rows(x, "causal_conv x")
        return self.program(self.conv_kind, width=int(weight.shape[-1]))(x, weight, bias, activation)

    def linear_attention(self, q, k, v, log_decay, beta, *, scale):
        self._check_rows(q, "linear_attention q")
        return self.program(self.linear_attention_kind)(q, k, v, log_decay, beta, scale)

    def _check_rows(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.shape[0] != self.num_rows:
            raise ModelInputError(f"{type(self).__name__} of microbatch {self.layout.microbatch}: {what} has "
                                  f"{tensor.shape[0]} rows, expected {self.num_rows}")


class TreeView(_LayoutPrograms):
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
        self._linear_rows: LinearRows | None = None

    def __repr__(self) -> str:
        layout = self.layout
        return (
            f"TreeView(microbatch={layout.microbatch}, rows={layout.num_rows}, sequences={layout.num_sequences}, "
            f"rounds={layout.num_rounds}, chunk_size={self.chunk_size})"
        )

    def input_ids(self, tokens) -> torch.Tensor:
        """[C] token ids of the rows, from the batch's per-trajectory token arrays."""
        return torch.as_tensor(self.layout.input_ids(tokens), dtype=torch.long).to(self.device)

    #: whether the linear-attention layers run on the packed rows (see the module docstring)
    pack_linear_rows = False

    def linear_rows(self) -> LinearRows:
        """Where the linear-attention layers run: with :attr:`pack_linear_rows`, the packed rows of
        :func:`harts.codegen.fx.linear_rows` when a round replays rows; else these rows."""
        if self._linear_rows is None:
            self._linear_rows = SameRows(self)
            if self.pack_linear_rows:
                packed = self.programs.get(self.layout, "linear_rows", lambda: linear_rows(self.layout))
                if packed["has_replay"]:
                    self._linear_rows = PackedRowsView(self, packed)
        return self._linear_rows

    #: the program the full-attention layers run: ``"attention"`` (one gathered key/value view per sequence)
    #: or ``"cascade_attention"`` (split at the forks, :mod:`harts.kernels.attention.cascade`); the same result
    attention_program = "attention"

    def attention(self, q, k, v, *, scale):
        self._check_rows(q, "attention q")
        return self.program(self.attention_program)(q, k, v, scale)


class PackedRowsView(_LayoutPrograms):
    """A microbatch's linear-attention rows (:func:`harts.codegen.fx.linear_rows`) as an execution view and
    the maps into and out of them (:class:`~harts.runtime.view.LinearRows`).

    ``pack`` gathers compact rows into round order, replay rows repeated (backward sums each row's reads);
    ``unpack`` takes each compact row from its own packed row (backward: zeros at the replay rows). The
    convolution and linear attention run the packed programs; ``positions`` are the rows' own positions and
    ``row_weight`` is a row's multiplicity at its own packed row and 0 at a replay row, so weighted sums over
    packed rows count each semantic position once. Full attention is not among its operators.
    """

    conv_kind = "packed_conv"
    linear_attention_kind = "packed_linear_attention"

    def __init__(self, tree: TreeView, packed: dict[str, np.ndarray]):
        layout, programs, device = tree.layout, tree.programs, tree.device
        self.layout = layout
        self.chunk_size = tree.chunk_size
        self.device = device
        self.kernels = tree.kernels
        self.programs = programs
        self.num_rows = int(packed["rows"].size)
        rows, own = packed["rows"], packed["own"]

        def maps() -> tuple[RowGather, RowScatter]:
            pack = on_device(RowGather(layout.num_rows, [rows]), device)
            unpack = on_device(RowScatter(layout.num_rows, [np.arange(layout.num_rows)], [own], [rows.size]), device)
            return pack, unpack

        self._pack, self._unpack = programs.get(layout, ("linear_rows_maps", str(device)), maps)
        self.positions = programs.tensor(layout, "linear_rows_position", lambda: layout.row_position[rows], device,
                                         torch.long)

        def own_weight() -> np.ndarray:
            weight = np.zeros(rows.size, dtype=np.float64)
            weight[own] = layout.row_multiplicity
            return weight

        self.row_weight = programs.tensor(layout, "linear_rows_weight", own_weight, device, torch.get_default_dtype())

    @property
    def view(self) -> PackedRowsView:
        return self

    def __repr__(self) -> str:
        return (f"PackedRowsView(microbatch={self.layout.microbatch}, rows={self.num_rows}, "
                f"compact_rows={self.layout.num_rows}, rounds={self.layout.num_rounds})")

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [C, ...] -> [P, ...] in round order."""
        return self._pack(x)[0]

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """y [P, ...] -> [C, ...]: each compact row from its own packed row."""
        return self._unpack(y)
