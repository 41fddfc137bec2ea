"""Golden before/after IR for every pass: hand-checked IR text in, the exact IR text out.

Each file in ``golden/`` is one case: a comment saying what it shows, the pass (pipeline
text), the batch and the compile options its context carries, the input IR (empty for
``lower``, which starts from the batch) and the output IR. The input is parsed with
:func:`harts.ir.text.parse_ir` and run through the pass manager, which verifies both sides;
the output must print exactly as written. ``$batch`` stands for the batch's content hash.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from harts.rollouts.batch import RolloutBatch
from harts.ir.text import parse_ir, print_ir
from harts.options import CompileOptions
from harts.passes import PassContext, parse_pipeline
from harts.passes.manager import run_pipeline
from harts.passes.registry import BUILTIN_PASSES

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(GOLDEN.glob("*.ir"))
INPUT, OUTPUT = "// ----- input\n", "// ----- output\n"


@attrs.frozen
class GoldenCase:
    pipeline: str
    batch: RolloutBatch
    options: CompileOptions
    input: str
    output: str

    def resolve(self, text: str) -> str:
        return text.replace("$batch", self.batch.input_hash())


def load_case(path: Path) -> GoldenCase:
    text = path.read_text()
    header, rest = text.split(INPUT)
    before, after = rest.split(OUTPUT)
    fields = dict(line[3:].split(": ", 1) for line in header.splitlines() if line.startswith("// ") and ": " in line)
    return GoldenCase(
        pipeline=fields["pass"],
        batch=RolloutBatch.from_trajectories(json.loads(fields["batch"])),
        options=CompileOptions(**json.loads(fields["options"])),
        input=before,
        output=after,
    )


@pytest.mark.parametrize("path", CASES, ids=lambda path: path.stem)
def test_the_pass_turns_the_input_ir_into_the_expected_ir(path):
    case = load_case(path)
    module = parse_ir(case.resolve(case.input)) if case.input.strip() else None
    result = run_pipeline(module, parse_pipeline(case.pipeline), PassContext(batch=case.batch, options=case.options))
    expected = case.resolve(case.output)
    assert print_ir(result) == expected
    assert result == parse_ir(expected)


def test_every_built_in_pass_has_a_golden_case():
    assert {parse_pipeline(load_case(path).pipeline)[0].name for path in CASES} == set(BUILTIN_PASSES)

