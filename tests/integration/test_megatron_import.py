"""Importing the megatron backend's module, in a fresh interpreter, does not import megatron-core
(it loads only when the backend is built). The rest of the backend is tested in process in
tests/unit/test_trainer_megatron.py."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_module_does_not_import_megatron():
    code = ("import sys, tiderl.trainer.megatron, tiderl.trainer.parallel; "
            "assert 'megatron' not in sys.modules, 'megatron imported at module level'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
