"""Flower messages outside Flower's processes, for the fleet's message-level tests: the task identity a
ServerApp process has (Flower stamps every message with it) and a Grid as far as sampling nodes goes."""

from __future__ import annotations

import contextlib
from typing import Iterator

from flwr.supercore.task_identity import TaskIdentity


@contextlib.contextmanager
def task_identity() -> Iterator[None]:
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class Nodes:
    """A Grid as far as sampling goes: the connected SuperNodes' ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_node_ids(self) -> list[int]:
        return self.ids
