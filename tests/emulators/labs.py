"""Emulated vendor labs: each a glm5_hal plugin registering one vendor adapter over its CPU
emulator, so that the conformance command (`glm5-hal conformance`, with its worker
processes) runs the real adapter code exactly as a vendor's lab runs the installed plugin.

`scripts/emulated_conformance.py` installs one lab at a time through the `glm5_hal.backends`
entry-point group (a generated `.dist-info`, as `pip install` would leave) and writes one
report per lab. The backends are named `<vendor>_emu`: an emulated result is never shown
under the real backend's name. The chips are those the adapter tests run
(tests/test_<vendor>.py), with the emulators' defaults otherwise.
"""
from __future__ import annotations

from typing import Callable

import glm5_hal as hal


def _ascend(chip: str):
    from glm5_hal.backends.ascend import AscendBackend
    from .ascend import NpuEmulator
    return AscendBackend(runtime=NpuEmulator(chip), name="ascend_emu", device_type="cpu", priority=1000)


def _musa(card: str):
    from glm5_hal.backends.musa import MusaBackend
    from .musa import MusaEmulator
    return MusaBackend(runtime=MusaEmulator(card), name="musa_emu", device_type="cpu", priority=1000)


def _dcu(card: str):
    from glm5_hal.backends.dcu import DcuBackend
    from .dcu import DcuEmulator
    return DcuBackend(runtime=DcuEmulator(card), name="dcu_emu", device_type="cpu", priority=1000)


def _cambricon(chip: str):
    from glm5_hal.backends.cambricon import CambriconBackend
    from .cambricon import MluEmulator
    return CambriconBackend(runtime=MluEmulator(chip), name="cambricon_emu", device_type="cpu", priority=1000)


def _kunlun(chip: str):
    from glm5_hal.backends.kunlun import KunlunBackend
    from .kunlun import XpuEmulator
    return KunlunBackend(runtime=XpuEmulator(chip), name="kunlun_emu", device_type="cpu", priority=1000)


def _iluvatar(card: str):
    from glm5_hal.backends.iluvatar import IluvatarBackend
    from .iluvatar import IluvatarEmulator
    return IluvatarBackend(runtime=IluvatarEmulator(card), name="iluvatar_emu", device_type="cpu", priority=1000)


def _enflame(chip: str):
    from glm5_hal.backends.enflame import EnflameBackend
    from .enflame import GcuEmulator
    return EnflameBackend(runtime=GcuEmulator(chip), name="enflame_emu", device_type="cpu", priority=1000)


class Lab:
    """A plugin object (pluggy takes any object with the hook) registering one emulated chip."""

    def __init__(self, key: str, make: Callable[[str], hal.Backend], chip: str):
        self.key, self.chip, self._make = key, chip, make
        self.attribute = key.replace("-", "_").lower()

    @property
    def backend_name(self) -> str:
        return self.backend().name

    def backend(self) -> hal.Backend:
        return self._make(self.chip)

    @hal.hookimpl
    def glm5_hal_register_backends(self, register) -> None:
        register(self.backend())


LABS = {lab.key: lab for lab in (
    Lab("ascend-910B", _ascend, "910B"), Lab("ascend-950", _ascend, "950"),
    Lab("musa-S4000", _musa, "S4000"), Lab("musa-S5000", _musa, "S5000"),
    Lab("dcu-K100_AI", _dcu, "K100_AI"), Lab("dcu-Z100L", _dcu, "Z100L"),
    Lab("cambricon-MLU370", _cambricon, "MLU370"), Lab("cambricon-MLU590", _cambricon, "MLU590"),
    Lab("cambricon-cap6", _cambricon, "cap6"),
    Lab("kunlun-P800", _kunlun, "P800"),
    Lab("iluvatar-BI-V150", _iluvatar, "BI-V150"),
    Lab("enflame-gcu400", _enflame, "gcu400"),
)}

# the entry-point targets: `emulators.labs:<attribute>`
globals().update({lab.attribute: lab for lab in LABS.values()})
