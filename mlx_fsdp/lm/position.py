"""mlx-lm's batch order, resumable at any iteration.

``mlx_lm.tuner.trainer.iterate_batches`` sorts the examples by length, cuts
them into batches (each rank takes every N-th example of a batch) and visits
the batches in a ``numpy.random.permutation`` drawn at the first batch of
every pass over the data, from NumPy's global generator. Evaluation draws a
permutation of the validation batches from the same generator. So a run
resumed at iteration ``s`` sees the batches of the uninterrupted run, at any
N, when it

1. sets NumPy's global state to what it was when the pass holding batch
   ``s + 1`` drew its permutation, and pulls the pass's first ``s mod P``
   batches (``P`` batches per pass) again;
2. then sets it to what it was after iteration ``s``, so later passes and
   evaluations draw what they drew;
3. draws for evaluation where the uninterrupted run evaluated, whether or not
   the trainer evaluates there: the trainer counts iterations from 1 in every
   ``train`` call and evaluates on the first one and every ``steps_per_eval``
   after it, so a resumed run evaluates where its own count says. Evaluations
   the uninterrupted run did not run are kept from drawing; for those it ran
   and the resumed one does not, the permutation is drawn and dropped.

:class:`ResumableBatches` does this, and checks on every pass that the draws
happen where it expects them, so a change in mlx-lm cannot make a resumed
run silently train on other batches.
"""

from typing import Callable, Optional

import numpy as np

from .hooks import _changed


def _state_to_json(state) -> dict:
    name, keys, pos, has_gauss, gauss = state
    return {"name": name, "keys": keys.tolist(), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _state_from_json(d: dict):
    return (d["name"], np.array(d["keys"], dtype=np.uint32), d["pos"], d["has_gauss"], d["gauss"])


def _same(a, b) -> bool:
    return a[0] == b[0] and a[2:] == b[2:] and np.array_equal(a[1], b[1])


def batches_per_pass(num_examples: int, batch_size: int) -> int:
    """Batches in one pass of ``iterate_batches`` (a partial last batch is dropped)."""
    return (num_examples - batch_size) // batch_size + 1


class ResumableBatches:
    """An ``iterate_batches`` for ``mlx_lm.tuner.trainer.train`` that can start at iteration ``start``.

    Pass it as ``train(..., iterate_batches=batches)``. Training (the call
    with ``loop=True``) yields the batches of iterations ``start + 1``,
    ``start + 2``, ...; evaluation calls go to ``iterate`` unchanged.

    Args:
        iterate (Callable): mlx-lm's ``iterate_batches`` (or one with its
            arguments and its order).
        steps_per_eval (int): The trainer's evaluation interval.
        iters (int): The iteration the whole run ends at (not what is left).
        start (int): Iterations already done. Default: ``0``.
        position (dict, optional): :meth:`position` as saved at ``start``;
            required when ``start > 0``. Default: ``None``.
        on_step (Callable, optional): Called with the iteration number after
            each iteration's step, when the next batch is asked for (so not
            after the last one). Default: ``None``.
    """

    def __init__(self, iterate: Callable, *, steps_per_eval: int, iters: int, start: int = 0,
                 position: Optional[dict] = None, on_step: Optional[Callable] = None):
        if start and position is None:
            raise ValueError(f"start={start} needs the data position saved at that iteration.")
        self.iterate = iterate
        self.steps_per_eval = steps_per_eval
        self.iters = iters
        self.start = start
        self.on_step = on_step
        self.iteration = start
        self._position = position
        self._pass_state = _state_from_json(position["pass_state"]) if position else None
        self._after_pull = None
        self._per_pass = None
        self._quiet_eval = False
        self._eval_kwargs = None

    def _evaluates(self, it: int, *, since: int = 0, end: Optional[int] = None) -> bool:
        # Whether mlx-lm's trainer, called for the iterations after ``since`` up to
        # ``end``, evaluates before the step of iteration ``it``: on its first
        # iteration, every ``steps_per_eval`` of its own count, and on its last.
        local = it - since
        return local == 1 or local % self.steps_per_eval == 0 or it == end

    def position(self) -> dict:
        """The data position after the current iteration, as JSON-able data."""
        now = np.random.get_state()
        if self.iteration == self.iters and not self._evaluates(self.iteration):
            # The last iteration's evaluation drew, but a longer run would not have.
            now = self._after_pull
        return {"iteration": self.iteration, "batches_per_pass": self._per_pass,
                "pass_state": _state_to_json(self._pass_state), "state": _state_to_json(now)}

    def __call__(self, dataset, batch_size, max_seq_length, loop=False, seed=None,
                 comm_group=None):
        kwargs = dict(dataset=dataset, batch_size=batch_size, max_seq_length=max_seq_length,
                      loop=loop, seed=seed, comm_group=comm_group)
        if loop:
            return self._training(kwargs, batches_per_pass(len(dataset), batch_size))
        self._eval_kwargs = kwargs
        if self._quiet_eval:
            self._quiet_eval = False
            return self._without_drawing(self.iterate(**kwargs))
        return self.iterate(**kwargs)

    @staticmethod
    def _without_drawing(batches):
        # The permutation is drawn at the first batch: put the state back after it.
        state = np.random.get_state()
        try:
            first = next(batches)
        except StopIteration:
            return
        finally:
            np.random.set_state(state)
        yield first
        yield from batches

    def _training(self, kwargs, per_pass: int):
        batches = self.iterate(**kwargs)
        self._per_pass = per_pass
        if self.start:
            self._seek(batches, per_pass)
        pulled = self.start
        while True:
            if self.iteration > self.start and self.on_step is not None:
                self.on_step(self.iteration)
            new_pass = pulled % per_pass == 0
            before = np.random.get_state()
            if new_pass:
                self._pass_state = before
            batch = next(batches)
            pulled += 1
            self._after_pull = np.random.get_state()
            # A permutation of one batch draws nothing.
            if per_pass > 1 and new_pass == _same(before, self._after_pull):
                raise _changed(
                    "the order of iterate_batches (expected one numpy.random.permutation "
                    f"at the first of every {per_pass} batches); a resumed run could not "
                    "continue the data order"
                )
            self.iteration += 1
            self._match_evaluation_draws(self.iteration)
            yield batch

    def _seek(self, batches, per_pass: int):
        # Steps 1 and 2 of the module docstring.
        if self._position["batches_per_pass"] != per_pass:
            raise ValueError(
                f"The training data has {per_pass} batches per pass, but the run was saved "
                f"with {self._position['batches_per_pass']}; resume on the same data."
            )
        if self.start % per_pass:
            np.random.set_state(self._pass_state)
            for _ in range(self.start % per_pass):
                next(batches)
        np.random.set_state(_state_from_json(self._position["state"]))

    def _match_evaluation_draws(self, it: int):
        # Called between the pull of batch ``it`` and the evaluation before its step.
        whole_run = self._evaluates(it, end=self.iters)
        this_call = self._evaluates(it, since=self.start, end=self.iters)
        if whole_run and not this_call and self._eval_kwargs is not None:
            next(self.iterate(**self._eval_kwargs), None)
        elif this_call and not whole_run:
            self._quiet_eval = True
