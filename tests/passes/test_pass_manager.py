"""The pass contract as the manager enforces it, the lazy registry, typed options, shared defaults."""

from __future__ import annotations

import inspect
import subprocess
import sys

import attrs
import pytest

import harts
from harts.errors import IRVerificationError, PipelineError, PlanningError
from harts.ir.nodes import Module, Phase
from harts.options import DEFAULT_OPTIONS, CompileOptions
from harts.passes import PASS_REGISTRY, Pass, PassContext, PassRegistry, lower, option, parse_pipeline
from harts.passes.manager import run_pipeline
from harts.passes.prefix_compress import PrefixCompress
from harts.passes.registry import BUILTIN_PASSES


def small_batch():
    return harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4, 5], [9]])


@attrs.frozen
class ClaimsCompression(Pass):
    """Declares that it compresses, but returns its input unchanged."""

    name = "test-claims-compression"
    requires = Phase.LOWERED
    produces = Phase.COMPRESSED

    def run(self, module: Module, ctx: PassContext) -> Module:
        return module


@attrs.frozen
class ReturnsText(Pass):
    name = "test-returns-text"
    requires = Phase.LOWERED
    produces = Phase.LOWERED

    def run(self, module: Module, ctx: PassContext):
        return "not a module"


@attrs.frozen
class BreaksTheTrie(Pass):
    """Keeps the phase but breaks an invariant of it."""

    name = "test-breaks-the-trie"
    requires = Phase.COMPRESSED
    produces = Phase.COMPRESSED

    def run(self, module: Module, ctx: PassContext) -> Module:
        return attrs.evolve(module, trie=attrs.evolve(module.trie, compact_tokens=module.trie.compact_tokens + 1))


@attrs.frozen
class Annotated(Pass):
    """Option annotations that would not evaluate: text conversion never reads them."""

    name = "test-annotated"
    requires = Phase.LOWERED
    produces = Phase.LOWERED

    rounds: "NoSuchType" = option(2, minimum=1)  # noqa: F821 - never evaluated, on purpose
    ratio: "AlsoMissing | None" = option(None, kind=float)  # noqa: F821
    strict: bool = option(False)
    plain: int = 0

    def run(self, module: Module, ctx: PassContext) -> Module:
        return module


def lowered():
    batch = small_batch()
    return batch, lower(batch)


def test_a_pass_that_leaves_the_wrong_phase_is_rejected_by_name():
    batch, module = lowered()
    with pytest.raises(PipelineError, match=r"pass 'test-claims-compression' must produce phase compressed but returned phase lowered"):
        run_pipeline(module, [ClaimsCompression()], PassContext(batch=batch))
    with pytest.raises(PipelineError, match=r"pass 'test-returns-text' must produce phase lowered but returned str"):
        run_pipeline(module, [ReturnsText()], PassContext(batch=batch))


def test_the_same_pass_also_fails_with_verification_off():
    # produces is part of the contract, not of verification
    batch, module = lowered()
    with pytest.raises(PipelineError, match="must produce phase compressed"):
        run_pipeline(module, [ClaimsCompression()], PassContext(batch=batch), verify_each=False)


def test_errors_name_the_failing_pass_and_the_passes_run_before_it():
    batch = small_batch()
    passes = parse_pipeline("lower,prefix-compress") + [BreaksTheTrie()]
    with pytest.raises(IRVerificationError) as caught:
        run_pipeline(None, passes, PassContext(batch=batch))
    message = str(caught.value)
    assert "output of pass 'test-breaks-the-trie' is invalid" in message
    assert "passes run before it: lower, prefix-compress" in message
    assert "compact_tokens is 7" in message
    with pytest.raises(PipelineError, match=r"pass 'segment' needs phase scheduled but the module is compressed \(passes run before it: lower, prefix-compress\)"):
        run_pipeline(None, parse_pipeline("lower,prefix-compress,segment"), PassContext(batch=batch))


def test_errors_raised_inside_a_pass_name_it_and_keep_their_type():
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3], [4] * 9, [5, 6]])
    with pytest.raises(PlanningError) as caught:
        harts.compile(batch, capacity=8)
    message = str(caught.value)
    assert message.startswith("pass 'partition-microbatches' failed (passes run before it: lower, prefix-compress): ")
    assert "trajectory 1 has 9 tokens, more than the microbatch capacity 8" in message


def test_an_invalid_input_module_is_reported_as_the_input():
    batch, module = lowered()
    broken = attrs.evolve(module, chunk_size=0)
    with pytest.raises(IRVerificationError, match=r"the pipeline's input is invalid: module field 'chunk_size' must be positive"):
        run_pipeline(broken, [PrefixCompress()], PassContext(batch=batch))


def test_lower_starts_pipelines_and_only_starts_them():
    batch, module = lowered()
    with pytest.raises(PipelineError, match=r"pass 'lower' starts a pipeline from the batch, but it comes after a lowered module"):
        run_pipeline(module, parse_pipeline("lower"), PassContext(batch=batch))
    with pytest.raises(PipelineError, match=r"pass 'prefix-compress' needs phase lowered, but the pipeline has no module yet"):
        run_pipeline(None, parse_pipeline("prefix-compress"), PassContext(batch=batch))
    with pytest.raises(PipelineError, match="pass 'lower' needs the rollout batch"):
        run_pipeline(None, parse_pipeline("lower"), PassContext())
    result = run_pipeline(None, parse_pipeline("lower"), PassContext(batch=batch, options=CompileOptions(capacity=7, chunk_size=2)))
    assert result == lower(batch, capacity=7, chunk_size=2)


def test_importing_harts_imports_no_pass_until_one_is_looked_up():
    code = (
        "import sys, harts, harts.passes\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('harts.passes.', 'harts.planner')))\n"
        "print(','.join(loaded), 'torch' in sys.modules)\n"
        "harts.passes.PASS_REGISTRY['segment']\n"
        "print('harts.passes.segment' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = result.stdout.split("\n")[:2]
    loaded, torch_loaded = first.split(" ")
    # lowering and code generation are the ends compile() supplies; the planning passes load on lookup
    assert set(loaded.split(",")) == {"harts.passes.base", "harts.passes.lay_out", "harts.passes.lower", "harts.passes.manager", "harts.passes.registry"}
    assert torch_loaded == "False"
    assert second == "True"


def test_a_temporarily_registered_pass_does_not_outlive_its_block():
    assert ClaimsCompression.name not in PASS_REGISTRY
    with PASS_REGISTRY.registered(ClaimsCompression):
        assert PASS_REGISTRY[ClaimsCompression.name] is ClaimsCompression
        assert parse_pipeline("test-claims-compression") == [ClaimsCompression()]
    assert ClaimsCompression.name not in PASS_REGISTRY
    with pytest.raises(RuntimeError), PASS_REGISTRY.registered(ClaimsCompression):
        raise RuntimeError("the block fails")
    assert ClaimsCompression.name not in PASS_REGISTRY
    with pytest.raises(PipelineError, match="unknown pass 'test-claims-compression'"):
        parse_pipeline("test-claims-compression")


def test_registry_lists_the_built_in_passes_in_pipeline_order_and_refuses_a_second_class_for_a_name():
    assert list(PASS_REGISTRY)[: len(BUILTIN_PASSES)] == list(BUILTIN_PASSES)
    assert list(BUILTIN_PASSES) == list(harts.DEFAULT_PIPELINE)
    impostor = type("Impostor", (ClaimsCompression,), {"name": "segment"})
    with pytest.raises(ValueError, match="registered twice"):
        PassRegistry(BUILTIN_PASSES).register(impostor)


def test_options_are_typed_fields_of_a_frozen_pass_and_text_never_evaluates_annotations():
    (parsed,) = parse_pipeline("test-annotated{rounds=5,ratio=0.25,strict=true}", registry={"test-annotated": Annotated})
    assert parsed == Annotated(rounds=5, ratio=0.25, strict=True)
    assert parsed.to_text() == "test-annotated{rounds=5,ratio=0.25,strict=true}"
    assert parse_pipeline("test-annotated{ratio=none}", registry={"test-annotated": Annotated})[0].ratio is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        parsed.rounds = 1
    for text, message in [
        ("test-annotated{rounds=0}", "option 'rounds' must be an integer >= 1, got 0"),
        ("test-annotated{rounds=two}", "option rounds='two' is not a valid integer"),
        ("test-annotated{strict=maybe}", "option strict='maybe' is not a valid boolean"),
        ("test-annotated{plain=3}", "option 'plain' is not declared with harts.passes.option"),
        ("test-annotated{colour=3}", "has no option 'colour'"),
    ]:
        with pytest.raises(PipelineError, match=message):
            parse_pipeline(text, registry={"test-annotated": Annotated})
    with pytest.raises(PipelineError, match="option 'strict' must be a boolean, got 1"):
        Annotated(strict=1)


def test_segment_requires_the_scheduled_phase_that_its_output_claims():
    segment = PASS_REGISTRY["segment"]
    assert segment.requires == Phase.SCHEDULED and segment.produces == Phase.SEGMENTED


def test_one_options_object_holds_the_defaults_of_compile_lower_and_the_cli():
    from harts.cli import compile_command

    assert (DEFAULT_OPTIONS.capacity, DEFAULT_OPTIONS.dp_size, DEFAULT_OPTIONS.chunk_size) == (65536, 1, 64)
    for function in (harts.compile, lower):
        parameters = inspect.signature(function).parameters
        assert {name: parameters[name].default for name in ("capacity", "dp_size", "chunk_size")} == attrs.asdict(DEFAULT_OPTIONS)
    cli = inspect.signature(compile_command).parameters
    assert (cli["capacity"].default.default, cli["dp"].default.default, cli["chunk_size"].default.default) == (65536, 1, 64)
    with pytest.raises(PipelineError, match="option 'dp_size' must be a positive integer, got 0"):
        CompileOptions(dp_size=0)
