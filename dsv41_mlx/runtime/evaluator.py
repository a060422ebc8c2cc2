"""A thread that starts each block's evaluation while the caller builds the next block.

A decode step spends about half of its host time building the blocks' graphs (Python and
the compiled methods' replays) and half inside `mx.async_eval` (MLX encoding each kernel
and committing the work), one after the other on one thread, and on a slow host the GPU
waits for them. `mx.async_eval` releases the GIL while MLX encodes, so a second thread can
encode block i while the first builds block i + 1 (on a fast host the GPU already sets the
pace).

MLX lets a stream be used from one thread only, except streams made by
`mx.new_thread_unsafe_stream`, which any thread may evaluate as long as two threads never
evaluate at once. So the forward builds its graph on the evaluator's stream, the thread
evaluates the blocks in the order they were handed over, and the caller `drain`s the
thread (waits until it has started everything handed over) before it evaluates anything
on that stream or reads what the thread was handed. The graph, its kernels and their order
are the same as with `mx.async_eval` on the caller's thread: the same bits
(tests/test_model.py).

Meanwhile the caller may wait for an array of its own stream, but not for one the handed
graph reads: MLX's wait (`item()`, `eval`) and the thread's `mx.async_eval` both drop a
finished input's event, and on one array from two threads at once that is a race (a CI run
hung in it). Runner.decode_ahead therefore gives its forward its own node
(`mx.stop_gradient`, no copy) of the token the caller then reads.

Where the thread falls behind, it starts the blocks handed over meanwhile together (at most
`batch` of them): each `mx.async_eval` call pays for a commit of its work (on CUDA, a
graph updated and launched). A large batch starts late, though: the GPU sits idle until its
first graph launch. Hence at most BATCH (2 gave the shortest one-row steps).

A thread waiting for the GIL gets it only when the holder yields it, which a busy Python
thread does every `sys.getswitchinterval()` (5 ms by default): longer than a block takes
to build. The evaluator therefore asks for a short interval while it runs forwards
(SWITCH_INTERVAL), restored when the last evaluator is closed.
"""

from __future__ import annotations

import queue
import sys
import threading

import mlx.core as mx

SWITCH_INTERVAL = 10e-6  # seconds: how soon a waiting thread gets the GIL from a busy one
BATCH = 2  # the most blocks one mx.async_eval starts by default


class BlockEvaluator:
    """Evaluates (mx.async_eval) what `submit` hands it, in order, on a thread of its own.

    Build the graph under `with mx.stream(evaluator.stream)`; `drain` before evaluating
    anything on the caller's thread; `close` when done (the thread holds the evaluator: an
    evaluator left open lasts as long as the process, its thread asleep)."""

    _open = 0  # evaluators running: the GIL's switch interval is ours while any is
    _saved_interval: float | None = None

    def __init__(self, device: mx.Device | mx.DeviceType | None = None, batch: int | None = BATCH):
        # at most this many of the blocks handed over meanwhile go into one mx.async_eval (None: all)
        self.batch = batch
        self.stream = mx.new_thread_unsafe_stream(device if device is not None else mx.default_device())
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        if BlockEvaluator._open == 0:
            BlockEvaluator._saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL)
        BlockEvaluator._open += 1
        self._thread = threading.Thread(target=self._run, name="dsv41-block-evaluator", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while (isinstance(jobs[-1], tuple) and not self._jobs.empty()  # (the one reader: get won't wait)
                   and (self.batch is None or len(jobs) < self.batch)):
                jobs.append(self._jobs.get())
            arrays = [a for job in jobs if isinstance(job, tuple) for a in job]  # in order, one commit
            if arrays and self._error is None:  # after a failure, nothing more until the caller has seen it
                try:
                    mx.async_eval(*arrays)
                except BaseException as e:  # handed to the caller's thread by drain
                    self._error = e
            if jobs[-1] is None:  # close
                return
            if isinstance(jobs[-1], threading.Event):  # drain
                jobs[-1].set()

    def submit(self, *arrays: mx.array) -> None:
        """Start evaluating arrays (after everything submitted before them)."""
        if self._closed:
            raise RuntimeError("this BlockEvaluator is closed")
        self._jobs.put(arrays)

    def mark(self) -> threading.Event:
        """An event the thread sets once it has started everything submitted before this call
        (drain(mark) waits for it: what comes later may still be starting)."""
        if self._closed:
            raise RuntimeError("this BlockEvaluator is closed")
        done = threading.Event()
        self._jobs.put(done)
        return done

    def drain(self, mark: threading.Event | None = None) -> None:
        """Wait until everything submitted has been started (up to `mark`, where given); raise
        what the thread raised. Closed, the thread started everything before it stopped."""
        if self._closed and mark is None:
            return
        (mark or self.mark()).wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()
        BlockEvaluator._open -= 1
        if BlockEvaluator._open == 0 and BlockEvaluator._saved_interval is not None:
            sys.setswitchinterval(BlockEvaluator._saved_interval)


def switched(evaluator: BlockEvaluator | None, on: bool) -> BlockEvaluator | None:
    """An owner's evaluator after turning it on (a new one where there was none) or off (closed):
    what the owner keeps (Drafter.evaluate_on_thread)."""
    if on and evaluator is None:
        return BlockEvaluator()
    if not on and evaluator is not None:
        evaluator.close()
        return None
    return evaluator
