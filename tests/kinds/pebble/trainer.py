"""The pebble kind's trainer: registered, with one option of its own (never run by the test)."""

from __future__ import annotations

from ..base import trainer
from ...training.options import option, positive_int


@trainer("pebble")
class PebbleTrainer:
    arg_defaults: dict = {}


def add_arguments(t) -> None:
    option(t, "--pebble-steps", type=positive_int, default=1, help="pebble: steps of nothing")
