"""``lay-out``: the compact physical layout of every microbatch, the stage the runtime executes (§4.2).

Its output is a :class:`~harts.ir.layout.LaidOutModule`: the rounded module, unchanged, and
one :class:`~harts.ir.layout.MicrobatchLayout` per microbatch (row order, map m,
multiplicities, sequences, replay and ancestor rows, exports and state sources). The plan
artifact stores the layouts as tensors; loading a plan runs from them without laying out again.

The stage prints as IR text (the layouts' arrays as arithmetic runs; it parses back) followed
by the torch.fx programs the runtime generates from each layout, as ``//`` comments: they
are derived, shown for reading, and built again by the runtime for its device and kernels.
"""

from __future__ import annotations

import attrs

from harts.codegen.layout import lay_out
from harts.ir.layout import LaidOutModule
from harts.ir.nodes import Module
from harts.ir.text import print_ir
from harts.passes.base import Pass, PassContext
from harts.passes.registry import builtin_pass


def _commented(text: str) -> str:
    return "".join(f"// {line}".rstrip() + "\n" for line in text.splitlines())


@builtin_pass("lay-out")
@attrs.frozen
class LayOut(Pass):
    def run(self, module: Module, ctx: PassContext) -> LaidOutModule:
        ctx.report(self.name, 0.0)
        return lay_out(module)

    def render(self, result: LaidOutModule) -> str:
        # Not a cycle: compiling needs numpy only, so torch (behind the programs) loads on first print.
        from harts.codegen import fx

        parts = [print_ir(result)]
        for microbatch, layout in zip(result.module.microbatches, result.layouts):
            header = f"===== programs of microbatch {microbatch.index} (replica {microbatch.replica}, slot {microbatch.slot}) =====\n"
            parts.append(_commented(header + fx.render_programs(layout)))
        return "".join(parts)
