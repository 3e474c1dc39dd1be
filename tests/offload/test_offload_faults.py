"""Injected I/O faults give the documented behaviour: a clear OffloadError, or the tensor kept; never a wrong value."""
from __future__ import annotations

import copy
import errno
import gc
import os

import pytest
import torch

from _offload_models import assert_identical, mlp, run_steps
from datapath.offload import OffloadError, TensorCache


def _loss(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def _setup(tmp_path, **kw: object) -> tuple[torch.nn.Module, list[torch.Tensor], list, TensorCache]:
    torch.manual_seed(0)
    model = mlp(64, 4)
    batches = [torch.randn(64, 64) for _ in range(2)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    opts: dict[str, object] = dict(min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0, io_chunk_bytes=8192)
    opts.update(kw)
    cache = TensorCache("ssd", str(tmp_path), **opts)
    cache.attach(model)
    return model, batches, ref, cache


def _failing_write(code: int):
    def pwrite(fd: int, mv: memoryview, off: int) -> int:
        raise OSError(code, os.strerror(code))
    return pwrite


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_error_raises_in_the_step(tmp_path, code: int) -> None:
    model, batches, _, cache = _setup(tmp_path)
    cache.file_store.posix.pwrite = _failing_write(code)
    with pytest.raises(OffloadError) as info:
        run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert info.value.errno == code
    assert isinstance(info.value, OSError)
    assert "failed" in str(info.value) and info.value.filename
    assert cache.stats.store_errors > 0
    cache.close(raise_errors=False)
    del info  # the traceback holds the step's graph; once it goes, the directory goes
    gc.collect()
    assert not os.path.exists(cache.directory)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_error_keeps_tensor_when_asked(tmp_path, code: int) -> None:
    model, batches, ref, cache = _setup(tmp_path, on_error="keep")
    cache.file_store.posix.pwrite = _failing_write(code)
    got = run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert_identical(ref, got)
    st = cache.stats
    assert st.store_errors == st.storages_offloaded > 0
    assert st.bytes_kept_error > 0 and st.bytes_offloaded == 0
    assert cache.files() == []  # partial files were removed
    cache.close()


def test_short_write_is_an_error(tmp_path) -> None:
    model, batches, _, cache = _setup(tmp_path)
    real = cache.file_store.posix.pwrite

    def short(fd: int, mv: memoryview, off: int) -> int:
        if len(mv) > 4096:
            return real(fd, mv[:4096], off)  # a partial write...
        return 0                             # ...then the device accepts nothing more
    cache.file_store.posix.pwrite = short
    with pytest.raises(OffloadError, match="short write") as info:
        run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert info.value.errno == errno.ENOSPC
    cache.close(raise_errors=False)


def test_partial_writes_that_progress_are_completed(tmp_path) -> None:
    model, batches, ref, cache = _setup(tmp_path, verify=True)
    real = cache.file_store.posix.pwrite
    calls = []

    def partial(fd: int, mv: memoryview, off: int) -> int:  # the kernel may write less than asked
        calls.append(len(mv))
        return real(fd, mv[:4096], off)
    cache.file_store.posix.pwrite = partial
    got = run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert_identical(ref, got)
    assert any(n > 4096 for n in calls) and cache.stats.bytes_loaded > 0
    cache.close()


def test_read_error_raises(tmp_path) -> None:
    model, batches, _, cache = _setup(tmp_path)

    def preadv(fd: int, bufs: list, off: int) -> int:
        raise OSError(errno.EIO, "Input/output error")
    cache.file_store.posix.preadv = preadv
    with pytest.raises(OffloadError) as info:
        run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert info.value.errno == errno.EIO
    assert cache.stats.load_errors > 0
    cache.close(raise_errors=False)
    del info
    gc.collect()
    assert not os.path.exists(cache.directory)


def test_missing_file_raises(tmp_path) -> None:
    model, batches, _, cache = _setup(tmp_path)

    def delete_files() -> None:
        cache.wait_io()
        for f in cache.files():
            os.unlink(os.path.join(cache.directory, f))
    with pytest.raises(OffloadError, match="vanished") as info:
        run_steps(model, batches, _loss, ctx=cache, between=delete_files)
    assert info.value.errno == errno.ENOENT
    cache.close(raise_errors=False)


def test_truncated_file_raises(tmp_path) -> None:
    model, batches, _, cache = _setup(tmp_path)

    def truncate() -> None:
        cache.wait_io()
        for f in cache.files():
            os.truncate(os.path.join(cache.directory, f), 0)
    with pytest.raises(OffloadError, match="short read|truncated"):
        run_steps(model, batches, _loss, ctx=cache, between=truncate)
    cache.close(raise_errors=False)


def test_corrupted_file_detected_with_verify(tmp_path) -> None:
    model, batches, _, cache = _setup(tmp_path, verify=True)

    def corrupt() -> None:
        cache.wait_io()
        for f in cache.files():
            path = os.path.join(cache.directory, f)
            with open(path, "r+b") as fh:
                b = fh.read(1)
                fh.seek(0)
                fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(OffloadError, match="checksum mismatch"):
        run_steps(model, batches, _loss, ctx=cache, between=corrupt)
    cache.close(raise_errors=False)


def test_disk_budget_bounds_files_and_keeps_the_rest(tmp_path) -> None:
    budget = 48 << 10
    model, batches, ref, cache = _setup(tmp_path, max_disk_bytes=budget)
    peak = []
    got = run_steps(model, batches, _loss, ctx=cache,
                    between=lambda: (cache.wait_io(), peak.append(sum(
                        os.path.getsize(os.path.join(cache.directory, f)) for f in cache.files()))))
    assert_identical(ref, got)
    assert cache.stats.bytes_kept_budget > 0 and cache.stats.bytes_offloaded > 0
    assert max(peak) <= budget and cache.stats.peak_disk_bytes <= budget
    assert cache.files() == []
    cache.close()


def test_host_budget_bounds_pinned_memory() -> None:
    torch.manual_seed(0)
    model = mlp(64, 4)
    batches = [torch.randn(64, 64) for _ in range(2)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    cache = TensorCache("host", min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0,
                        host_budget_bytes=40 << 10, host_slab_bytes=64 << 10)
    cache.attach(model)
    got = run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert_identical(ref, got)
    assert cache.stats.bytes_kept_budget > 0
    assert 0 < cache.stats.peak_host_bytes <= 40 << 10
    cache.close()
