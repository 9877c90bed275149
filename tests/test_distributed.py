"""Data-parallel training over MPI: `mpiexec -n 2` runs tests/mpi_worker.py, whose ranks
train on half batches; this process checks them against one process on whole batches.
Skipped without mpi4py and an mpiexec (pip install -e '.[distributed]')."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import tercomp as tc
from tercomp import distributed
from tercomp.training import data_parallel

import mpi_worker  # tests/ is on sys.path (pytest's rootdir insertion)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mpi_worker.py")

needs_mpi = pytest.mark.skipif(distributed.mpi4py is None or distributed.launcher() is None,
                               reason=f"no mpi4py or mpiexec ({distributed.EXTRA})")


def mpiexec(mode, out, timeout=120):
    """Run the worker's `mode` on 2 ranks; (returncode, stdout, stderr, seconds)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    r = subprocess.run([distributed.launcher(), "-n", "2", sys.executable, WORKER, mode, str(out)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.monotonic() - t0


def lines(out, rank, what):
    """What rank `rank` logged after `what`."""
    text = (out / f"rank-{rank}.log").read_text()
    return [ln[len(what) + 1:] for ln in text.splitlines() if ln.startswith(what + " ")]


def assert_params_close(got, want, rtol=1e-5):
    assert set(got) == set(want)
    for k in want:
        rel = np.abs(np.asarray(got[k], np.float64) - want[k]).max() / np.abs(want[k]).max()
        assert rel <= rtol, f"parameter {k}: max relative difference {rel:.2e} > {rtol}"


@pytest.fixture(scope="module")
def reference():
    """One process on whole batches: the losses and parameters after each step."""
    step = mpi_worker.make_step(seed=0)
    losses, params = [], []
    for x, y in mpi_worker.batches(mpi_worker.STEPS + 2):
        losses.append(step(x, y)[0])
        params.append(step.params())
    return losses, params


@needs_mpi
def test_two_ranks_train_as_one_process_and_stop_together(tmp_path, reference):
    rc, out, err, _ = mpiexec("train", tmp_path)
    assert rc == 0, f"{out}\n{err}"
    ref_losses, ref_params = reference
    n = mpi_worker.STEPS
    for rank in (0, 1):
        # the loss of the whole batch on every rank, step after step
        got = [float(ln.split()[0]) for ln in lines(tmp_path, rank, "loss")]
        np.testing.assert_allclose(got, ref_losses[:n], rtol=1e-5, err_msg=f"rank {rank}")
        # a NaN on rank 1 stops both, naming rank 1; a bad batch on rank 1 too
        assert lines(tmp_path, rank, "nan error:") == [
            f"training step {n + 1}: the loss is nan (from rank(s) 1 of 2); the update was "
            "skipped, the weights are those of the last finite step"], out
        assert lines(tmp_path, rank, "steps") == [str(n)]
    assert lines(tmp_path, 0, "failure error:") == [
        f"ExecutionError: training step {n + 1}: rank(s) 1 failed (their error says why); "
        "every rank stops"], out
    assert lines(tmp_path, 1, "failure error:")[0].startswith("InputError: training step: input x: "
                                                         "expected shape [8, 12], got [8, 11]")
    p0, p1 = (dict(np.load(tmp_path / f"params-{r}.npz")) for r in (0, 1))
    for k in p0:                            # identical, not merely close, on every rank
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
    assert_params_close(p0, ref_params[n - 1])

    # the checkpoint rank 0 wrote (and rank 1 did not) resumes in one process
    assert not (tmp_path / "ckpt-1.safetensors").exists()
    step = mpi_worker.make_step(seed=7)
    tc.load_checkpoint(str(tmp_path / "ckpt-0.safetensors"), step)
    for x, y in mpi_worker.batches(n + 2)[n:]:
        step(x, y)
    assert_params_close(step.params(), ref_params[-1])


@pytest.fixture(scope="module")
def accumulated():
    """One process, accumulate_calls=2, on whole batches: the losses of 4 calls and the
    parameters after them (2 updates)."""
    step = mpi_worker.make_step(seed=0, accumulate_calls=2)
    losses = [step(x, y)[0] for x, y in mpi_worker.batches()]
    assert step.steps == 2
    return losses, step.params()


@needs_mpi
def test_two_ranks_accumulate_calls_as_one_process(tmp_path, accumulated):
    """accumulate_calls=2 over 2 ranks: each rank sums its calls' gradients and they are
    exchanged once an update; the same losses and weights as one process. A NaN on rank
    1 in the second call of an accumulation stops both ranks, nothing applied; a
    checkpoint between the calls warns that the sums are not in it."""
    rc, out, err, _ = mpiexec("accumulate", tmp_path)
    assert rc == 0, f"{out}\n{err}"
    ref_losses, ref_params = accumulated
    for rank in (0, 1):
        got = [float(ln) for ln in lines(tmp_path, rank, "loss")]
        np.testing.assert_allclose(got, ref_losses, rtol=1e-5, err_msg=f"rank {rank}")
        assert lines(tmp_path, rank, "nan error:") == [
            "training step 3: the loss is nan (from rank(s) 1 of 2); the update was skipped, "
            "the weights are those of the last finite step"], out
        assert lines(tmp_path, rank, "steps") == ["2"]
    assert "1 call(s) into an accumulation of 2" in lines(tmp_path, 0, "warnings")[0]
    assert lines(tmp_path, 1, "warnings") == ["[]"]      # rank 1 writes no checkpoint
    p0, p1 = (dict(np.load(tmp_path / f"params-{r}.npz")) for r in (0, 1))
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
    assert_params_close(p0, ref_params)


def test_accumulate_calls_on_one_rank_computes_the_single_process_step(accumulated):
    step = mpi_worker.make_step(seed=0, data_parallel=True, accumulate_calls=2)
    losses = []
    for i, (x, y) in enumerate(mpi_worker.batches()):
        losses.append(step(x, y)[0])
        assert step.steps == (i + 1) // 2
    np.testing.assert_allclose(losses, accumulated[0], rtol=1e-6)
    assert_params_close(step.params(), accumulated[1], rtol=1e-6)


@needs_mpi
def test_a_rank_that_hangs_aborts_the_job_after_the_timeout(tmp_path):
    rc, out, err, seconds = mpiexec("hang", tmp_path)
    assert rc != 0 and seconds < 60, (rc, seconds)
    assert re.search(r"rank 0: training step 1: the gradient Allreduce: the other ranks did not "
                     r"answer within 3 s", err), err


@needs_mpi
def test_an_uncaught_exception_on_one_rank_aborts_every_rank(tmp_path):
    rc, out, err, seconds = mpiexec("crash", tmp_path)
    assert rc != 0 and seconds < 60, (rc, seconds)
    assert "RuntimeError: rank 1 fails outside the step" in err
    assert "rank 1: an uncaught RuntimeError ended this rank; aborting every rank" in err


def test_one_rank_without_mpi_computes_the_single_process_step(reference):
    # outside mpiexec a data-parallel step is a job of one rank: the same numbers
    step = mpi_worker.make_step(seed=0, data_parallel=True)
    assert isinstance(step, data_parallel.DataParallelStep) and step.world.size == 1
    for x, y in mpi_worker.batches():
        step(x, y)
    assert_params_close(step.params(), reference[1][mpi_worker.STEPS - 1])


def test_under_a_launcher_without_mpi4py_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(distributed, "mpi4py", None)
    monkeypatch.setattr(distributed, "_world", None)
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(tc.TercompError, match=r"started as one of 2 MPI ranks, but mpi4py is not "
                                              r"installed(.|\n)*pip install -e '\.\[distributed\]'"):
        distributed.init()


def test_data_parallel_options_are_checked():
    with pytest.raises(tc.TercompError, match="data_parallel must be True or False"):
        mpi_worker.make_step(data_parallel="yes")
    with pytest.raises(tc.TercompError, match="timeout must be a positive number"):
        distributed.init(timeout=0)


@needs_mpi
def test_a_launcher_that_gives_only_the_rank_is_no_size_mismatch(tmp_path, monkeypatch):
    """PMIx launchers may give each rank its rank (PMIX_RANK) and not the job's size:
    that is no reason to call mpiexec another MPI's. A size that disagrees with MPI's is."""
    rc, out, err, _ = mpiexec("rank-only", tmp_path)
    assert rc == 0, f"{out}\n{err}"
    assert [lines(tmp_path, r, "size") for r in (0, 1)] == [["2"], ["2"]]
    for var in distributed._SIZE_VARS + distributed._RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "_world", None)
    distributed.init()      # MPI starts here, as a singleton: the variable below is not real
    monkeypatch.setattr(distributed, "_world", None)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(tc.TercompError, match="the launcher started 2 ranks but MPI sees 1"):
        distributed.init()


class PerTensorSGD(tc.optim.Optimizer):
    """An update that looks at whole tensors: the step keeps the parameters apart (no
    packing), and the gradient buffer has one slice per parameter."""

    def init(self, params):
        return {"step": np.float32(0.0)}

    def update(self, grads, state, params):
        return ({k: p - 0.05 * grads[k] / tc.sqrt(tc.sum(grads[k] * grads[k]))
                 for k, p in params.items()}, {"step": state["step"] + 1.0})


def test_one_rank_with_unpacked_parameters_computes_the_single_process_step():
    def make(dp):
        mpi_worker.nn.manual_seed(0)
        x, y = mpi_worker.batches(1)[0]
        return tc.compile_train_step(mpi_worker.loss_fn, mpi_worker.MLP(), PerTensorSGD(), x, y,
                                     data_parallel=dp)
    one, dp = make(False), make(True)
    assert one.packing is None and dp.packing is None
    for x, y in mpi_worker.batches():
        assert dp(x, y)[0] == pytest.approx(one(x, y)[0], rel=1e-6)
    assert_params_close(dp.params(), one.params(), rtol=1e-6)


# -- BatchNorm and SyncBatchNorm ------------------------------------------------------------
def cnn_run(step, calls=None):
    """Each step's loss, grad norm, parameters and buffers over mpi_worker.images()."""
    out = []
    for x, y in calls or mpi_worker.images():
        loss = step(x, y)[0]
        out.append((loss, step.grad_norm, step.params(), step.buffers()))
    return out


@pytest.fixture(scope="module")
def cnn_reference():
    """The CNN with BatchNorm in one process on whole batches."""
    return cnn_run(mpi_worker.make_cnn_step())


def saved(out, i, rank):
    """(params, buffers) rank `rank` saved after step i."""
    z = dict(np.load(out / f"step{i}-{rank}.npz"))
    return ({k[7:]: v for k, v in z.items() if k.startswith("params/")},
            {k[8:]: v for k, v in z.items() if k.startswith("buffers/")})


@needs_mpi
def test_two_ranks_with_sync_batchnorm_train_as_one_process_on_the_whole_batch(tmp_path,
                                                                             cnn_reference):
    """SyncBatchNorm on 2 ranks with half batches: the losses, gradient norms, updated
    weights and running statistics of BatchNorm in one process on the whole batch."""
    rc, out, err, _ = mpiexec("syncbn", tmp_path)
    assert rc == 0, f"{out}\n{err}"
    for rank in (0, 1):
        logged = [ln.split() for ln in lines(tmp_path, rank, "loss")]
        np.testing.assert_allclose([float(f[0]) for f in logged],
                                   [r[0] for r in cnn_reference], rtol=1e-5)
        np.testing.assert_allclose([float(f[2]) for f in logged],
                                   [r[1] for r in cnn_reference], rtol=1e-5)
        assert [f[4] for f in logged] == ["5"] * 3       # 2 layers, one after the other: 2L + 1
    for i, (_, _, ref_params, ref_buffers) in enumerate(cnn_reference):
        (p0, b0), (p1, b1) = saved(tmp_path, i, 0), saved(tmp_path, i, 1)
        for k in p0:
            np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
        for k in ref_buffers:
            np.testing.assert_array_equal(b0[k], b1[k], err_msg=k)
        assert_params_close(p0, ref_params)
        assert_params_close(b0, ref_buffers)


@needs_mpi
def test_two_ranks_with_batchnorm_normalize_by_their_shard_and_average_running_stats(tmp_path):
    """BatchNorm on 2 ranks (as PyTorch's DDP): each rank normalizes by its own half, the
    loss is the mean of the halves' losses, and the running statistics, identical on both
    ranks, are the mean of what each half's forward makes of them."""
    rc, out, err, _ = mpiexec("batchnorm", tmp_path)
    assert rc == 0, f"{out}\n{err}"
    assert lines(tmp_path, 0, "loss") == lines(tmp_path, 1, "loss")
    losses = [float(ln.split()[0]) for ln in lines(tmp_path, 0, "loss")]
    mpi_worker.nn.manual_seed(0)                # rank 0's model, which both start from
    model = mpi_worker.CNN()
    for i, (x, y) in enumerate(mpi_worker.images()[:2]):
        params, buffers = model.state_dict(), model.buffers()
        halves = []
        for h in (slice(0, len(x) // 2), slice(len(x) // 2, None)):
            model.load_state_dict(params)
            model.load_buffers(buffers)
            loss, _ = mpi_worker.loss_fn(model, x[h], y[h])     # eager: updates the buffers
            halves.append((float(loss), model.buffers()))
        assert losses[i] == pytest.approx((halves[0][0] + halves[1][0]) / 2, rel=1e-5)
        (p0, b0), (p1, b1) = saved(tmp_path, i, 0), saved(tmp_path, i, 1)
        for k in p0:
            np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
        for k in b0:
            np.testing.assert_array_equal(b0[k], b1[k], err_msg=k)
        assert_params_close(b0, {k: (halves[0][1][k] + halves[1][1][k]) / 2 for k in b0})
        model.load_state_dict(p0)
        model.load_buffers(b0)


@pytest.mark.slow        # the two tests above check the same on 2 ranks
def test_one_rank_with_batchnorm_or_sync_batchnorm_computes_the_single_process_step(
        cnn_reference):
    for sync in (False, True):
        step = mpi_worker.make_cnn_step(sync=sync, data_parallel=True)
        assert step.world.size == 1 and len(step.sync) == 2 * sync
        for got, want in zip(cnn_run(step), cnn_reference):
            assert got[0] == pytest.approx(want[0], rel=1e-6)
            assert got[1] == pytest.approx(want[1], rel=1e-5)
            assert_params_close(got[2], want[2])
            assert_params_close(got[3], want[3])
    # accumulate_calls: every call's forward updates the running statistics, as on one process
    calls = mpi_worker.images(4)
    one = cnn_run(mpi_worker.make_cnn_step(accumulate_calls=2), calls)
    dp = cnn_run(mpi_worker.make_cnn_step(data_parallel=True, accumulate_calls=2), calls)
    for got, want in zip(dp, one):
        assert got[0] == pytest.approx(want[0], rel=1e-6)
        for k in want[2]:        # (after the first call the BatchNorm biases are still 0)
            np.testing.assert_allclose(got[2][k], want[2][k], rtol=1e-5, atol=1e-7, err_msg=k)
        assert_params_close(got[3], want[3])


def test_convert_sync_batchnorm_keeps_the_layers_state_and_checks_its_use():
    mpi_worker.nn.manual_seed(0)
    model = mpi_worker.CNN()
    model.bn.running_mean = np.full(6, 0.5, np.float32)
    model.bn1.eval()
    before, buffers = model.state_dict(), model.buffers()
    converted = tc.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model and isinstance(model.bn, tc.nn.SyncBatchNorm)
    assert isinstance(model.bn1, tc.nn.SyncBatchNorm) and not model.bn1.training
    assert isinstance(model.conv, tc.nn.BitConv2d)
    for k, v in before.items():
        np.testing.assert_array_equal(model.state_dict()[k], v)
    np.testing.assert_array_equal(model.buffers()["bn.running_mean"], buffers["bn.running_mean"])
    from tercomp.nn.syncbn import sync_layers
    assert [n for n, _ in sync_layers(model)] == ["bn"]       # bn1 is in eval mode
    x, y = mpi_worker.images(1)[0]
    with pytest.raises(tc.TercompError, match=r"SyncBatchNorm \(bn\) synchronizes whole shards, "
                                              r"not micro-batches(.|\n)*accumulate_calls="):
        tc.compile_train_step(mpi_worker.loss_fn, model, tc.optim.SGD(0.1), x, y, accumulate=2,
                              data_parallel=True)

    class Twice(tc.nn.Module):
        def __init__(self):
            self.bn = tc.nn.SyncBatchNorm(3)

        def forward(self, x):
            return self.bn(self.bn(x))
    with pytest.raises(tc.TercompError, match=r"SyncBatchNorm\(3\) ran twice in one data-parallel"):
        tc.compile_train_step(lambda m, x: tc.mean(m(x)), Twice(), tc.optim.SGD(0.1),
                              np.ones((4, 3), np.float32), data_parallel=True)
