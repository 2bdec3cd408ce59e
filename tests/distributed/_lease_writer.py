"""``python -m tests.distributed._lease_writer URL ENDPOINT``: save to S3, SIGKILLed once its data is written."""

from __future__ import annotations

import os
import signal
import sys

import torch

import checkpoint
from checkpoint import _save


def main(url: str, endpoint: str) -> None:
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "eu-west-1"}}

    def die(phase: str) -> None:
        if phase == "data_written":
            print("killed", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    _save._test_hook = die
    checkpoint.save({"w": torch.full((64, 8), 2.0), "version": 2}, url, storage_options=options)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
