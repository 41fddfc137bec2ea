"""Pass registry, pipeline text, instruments and verification switches."""

from __future__ import annotations

import io

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.errors import IRVerificationError, PipelineError
from harts.ir.nodes import Module, Phase
from harts.passes import PASS_REGISTRY, Pass, PassContext, PassRegistry, lower, option, parse_pipeline, pipeline_to_text
from harts.passes.base import PASS_NAME
from harts.passes.manager import DumpIR, PrintIRAfter, TimePasses, instruments_from_environment, run_pipeline
from tests.helpers import token_trees


@attrs.frozen
class CorruptMultiplicity(Pass):
    """Test-only pass that breaks an invariant, to show verification catches it."""

    name = "test-corrupt-multiplicity"
    requires = Phase.COMPRESSED
    produces = Phase.COMPRESSED

    amount: int = option(1)
    enabled: bool = option(True)
    scale: float | None = option(None, kind=float)
    label: str = option("x")

    def run(self, module: Module, ctx: PassContext) -> Module:
        if not self.enabled:
            return module
        nodes = list(module.trie.nodes)
        nodes[0] = attrs.evolve(nodes[0], multiplicity=nodes[0].multiplicity + self.amount)
        return attrs.evolve(module, trie=attrs.evolve(module.trie, nodes=tuple(nodes)))


@pytest.fixture(autouse=True)
def corrupt_pass_registered():
    """The test pass is known to pipelines for one test at a time, never beyond it."""
    with PASS_REGISTRY.registered(CorruptMultiplicity):
        yield


def small_batch():
    return harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4, 5], [9]])


def test_pipeline_text_round_trips_with_typed_options():
    invocations = parse_pipeline("prefix-compress, test-corrupt-multiplicity{amount=3,enabled=false,scale=0.5,label=y}")
    assert [i.name for i in invocations] == ["prefix-compress", "test-corrupt-multiplicity"]
    corrupt = invocations[1]
    assert (corrupt.amount, corrupt.enabled, corrupt.scale, corrupt.label) == (3, False, 0.5, "y")
    assert pipeline_to_text(invocations) == "prefix-compress,test-corrupt-multiplicity{amount=3,enabled=false,scale=0.5,label=y}"
    assert parse_pipeline(pipeline_to_text(invocations)) == invocations
    assert parse_pipeline("test-corrupt-multiplicity{scale=none}")[0].scale is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("prefix-compres", "unknown pass 'prefix-compres'"),
        ("test-corrupt-multiplicity{colour=2}", "has no option 'colour'"),
        ("test-corrupt-multiplicity{amount=many}", "amount='many' is not a valid"),
        ("test-corrupt-multiplicity{amount}", "must be key=value"),
        ("prefix-compress;;", "cannot parse pipeline text"),
    ],
)
def test_bad_pipelines_are_rejected(text, message):
    with pytest.raises(PipelineError, match=message):
        parse_pipeline(text)


def test_every_registered_pass_is_kebab_case_and_ordered():
    for name, pass_class in PASS_REGISTRY.items():
        assert name == pass_class.name
        assert PASS_NAME.fullmatch(name), name
        assert pass_class.requires is None or pass_class.produces >= pass_class.requires
    # the check above can fail: the same pattern rejects names that are not kebab-case
    for bad in ("Prefix-Compress", "prefix_compress", "-segment", "segment-", "min--call"):
        assert not PASS_NAME.fullmatch(bad)
        with pytest.raises(ValueError, match="kebab-case"):
            PassRegistry({}).register(type("BadlyNamed", (CorruptMultiplicity,), {"name": bad}))


def test_verification_after_each_pass_catches_a_bad_pass_and_can_be_switched_off():
    batch = small_batch()
    with pytest.raises(IRVerificationError, match="multiplicity"):
        harts.compile(batch, pipeline="prefix-compress,test-corrupt-multiplicity")
    plan = harts.compile(batch, pipeline="prefix-compress,test-corrupt-multiplicity", verify=False)
    assert plan.module.trie.nodes[0].multiplicity == 3


def test_verification_switch_from_environment(monkeypatch):
    monkeypatch.setenv("HARTS_VERIFY", "0")
    harts.compile(small_batch(), pipeline="prefix-compress,test-corrupt-multiplicity")


def test_pass_order_is_checked():
    batch = small_batch()
    module = lower(batch)
    with pytest.raises(PipelineError, match="needs phase compressed"):
        run_pipeline(module, parse_pipeline("test-corrupt-multiplicity"), PassContext(batch=batch))


def test_print_ir_after_named_and_all_passes():
    stream = io.StringIO()
    harts.compile(small_batch(), pipeline="prefix-compress,test-corrupt-multiplicity{enabled=false}",
                  instruments=[PrintIRAfter(["prefix-compress"], stream=stream)])
    assert stream.getvalue().count("// ----- IR after") == 1
    stream = io.StringIO()
    harts.compile(small_batch(), pipeline="prefix-compress,test-corrupt-multiplicity{enabled=false}",
                  instruments=[PrintIRAfter(None, stream=stream)])
    text = stream.getvalue()
    assert "IR after prefix-compress" in text and "IR after test-corrupt-multiplicity{enabled=false}" in text
    with pytest.raises(PipelineError, match="unknown pass"):
        PrintIRAfter(["no-such-pass"])


def test_dump_ir_writes_numbered_stages_that_parse(tmp_path):
    from harts.ir.text import parse_ir

    harts.compile(small_batch(), pipeline="prefix-compress", instruments=[DumpIR(tmp_path)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["000_lower.txt", "001_prefix-compress.txt"]
    assert parse_ir((tmp_path / "001_prefix-compress.txt").read_text()).phase == Phase.COMPRESSED


def test_instruments_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HARTS_DUMP_IR", str(tmp_path))
    monkeypatch.setenv("HARTS_TIME_PASSES", "1")
    monkeypatch.setenv("HARTS_PRINT_IR_AFTER", "prefix-compress")
    kinds = {type(i) for i in instruments_from_environment()}
    assert kinds == {DumpIR, TimePasses, PrintIRAfter}
    harts.compile(small_batch(), pipeline="prefix-compress")
    assert (tmp_path / "001_prefix-compress.txt").exists()


def test_time_passes_records_each_pass():
    timer = TimePasses()
    harts.compile(small_batch(), pipeline="prefix-compress", instruments=[timer])
    assert set(timer.seconds) == {"prefix-compress"}
    assert "total" in timer.report()


def test_bad_compile_options_are_named():
    with pytest.raises(PipelineError, match="'capacity' must be a positive integer"):
        harts.compile(small_batch(), capacity=0, pipeline="prefix-compress")
    with pytest.raises(PipelineError, match="expects a RolloutBatch"):
        harts.compile([[1, 2]], pipeline="prefix-compress")


@settings(max_examples=20, deadline=None)
@given(trajectories=token_trees(chunk_size=4, max_trajectories=10, max_length=30), tight=st.booleans())
def test_compile_hashing_beside_the_trie_and_planner_gives_the_plan_of_the_passes_run_one_by_one(trajectories, tight):
    """harts.compile hashes the batch in a worker thread while it builds the trie prefix-compress and runs the
    planner partition-microbatches take from the context: the plan (every stage, the input hash included) is the
    one the passes build on their own."""
    # the longest trajectory's length: every trajectory fits alone, so a plan exists, of several microbatches
    capacity, dp_size = (max(len(t) for t in trajectories), 1) if tight else (1 << 20, 2 if len(trajectories) > 1 else 1)
    batch = harts.RolloutBatch.from_trajectories(trajectories)
    fresh = harts.RolloutBatch.from_trajectories(trajectories)  # nothing cached: the hash is computed on its own
    plan = harts.compile(batch, capacity=capacity, dp_size=dp_size, chunk_size=4)
    one_by_one = run_pipeline(None, parse_pipeline(harts.compiler.default_pipeline_text()),
                              PassContext(batch=fresh, options=harts.CompileOptions(capacity=capacity, dp_size=dp_size, chunk_size=4)))
    assert plan.module.input_hash == fresh.input_hash() == batch.input_hash()
    assert plan.module == one_by_one.module
    assert plan.layouts == one_by_one.layouts


@pytest.mark.parametrize("partition", ["partition-microbatches", "partition-microbatches{refine=false,balance=false,exchange=false}",
                                       "partition-microbatches{greedy=false,exact_threshold=1}"])
def test_compile_plans_beside_the_hash_with_the_pipelines_own_partition_options(partition):
    """The planner run before the pipeline takes the options of the pipeline's partition-microbatches step, so a
    compile with non-default ones gives the plan of the passes run one by one (which plan for themselves)."""
    trajectories = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 8, 9, 9, 9, 9], [5, 5, 5], [5, 5, 6, 6, 6, 6, 6], [1, 2, 3, 4, 5, 6]]
    text = f"lower,prefix-compress,{partition},schedule-slots,segment,min-call-rounds"
    options = harts.CompileOptions(capacity=12, dp_size=2, chunk_size=2)
    plan = harts.compile(harts.RolloutBatch.from_trajectories(trajectories), capacity=12, dp_size=2, chunk_size=2, pipeline=text)
    one_by_one = run_pipeline(None, parse_pipeline(text) + [harts.passes.lay_out.LayOut()],
                              PassContext(batch=harts.RolloutBatch.from_trajectories(trajectories), options=options))
    assert plan.module == one_by_one.module
    assert plan.layouts == one_by_one.layouts


def test_a_prepared_plan_is_taken_only_for_the_inputs_it_was_planned_for():
    """PassContext.prepared_plan answers for the very trie object, equal lengths and equal planner options, and
    nothing else: a pass between prefix-compress and partition-microbatches that rebuilt the trie, other
    trajectories or other options make the pass plan afresh."""
    from harts.passes.prefix_compress import build_compact_trie
    from harts.planner import PlannerOptions

    tokens = harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4, 5]]).tokens
    trie, lengths, options, result = build_compact_trie(tokens), (3, 4), PlannerOptions(capacity=8, dp_size=1), object()
    ctx = PassContext(batch_plan=(trie, lengths, options, result))
    assert ctx.prepared_plan(trie, lengths, PlannerOptions(capacity=8, dp_size=1)) is result
    assert ctx.prepared_plan(build_compact_trie(tokens), lengths, options) is None  # an equal trie, another object
    assert ctx.prepared_plan(trie, (3, 5), options) is None
    assert ctx.prepared_plan(trie, lengths, PlannerOptions(capacity=8, dp_size=1, refine=False)) is None
    assert ctx.prepared_plan(None, lengths, options) is None
    assert PassContext().prepared_plan(trie, lengths, options) is None


@pytest.mark.parametrize("collector_on", [True, False])
def test_compiling_pauses_the_cyclic_collector_and_leaves_it_as_it_found_it(collector_on):
    """harts.compile runs without the cyclic collector (it allocates many IR nodes and frees few) and hands it
    back as it was, after a plan and after a failure alike; a collector the caller switched off stays off."""
    import gc

    from harts.passes.manager import Instrument

    class WatchCollector(Instrument):
        def __init__(self):
            self.seen = set()

        def before_pass(self, step, module):
            self.seen.add(gc.isenabled())

    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3, 4], [1, 2, 5]])
    was = gc.isenabled()
    try:
        (gc.enable if collector_on else gc.disable)()
        watch = WatchCollector()
        harts.compile(batch, chunk_size=2, instruments=[watch])
        assert watch.seen == {False} and gc.isenabled() == collector_on

        class Fails(Instrument):
            def after_pass(self, step, module, seconds):
                raise PipelineError("stop here")

        with pytest.raises(PipelineError, match="stop here"):
            harts.compile(batch, chunk_size=2, instruments=[Fails()])
        assert gc.isenabled() == collector_on
    finally:
        (gc.enable if was else gc.disable)()
