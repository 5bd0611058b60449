"""CPU emulators of vendor runtimes, written from the vendors' published documentation.

Adapter tests inject them in place of the real bridge (`AscendBackend(runtime=NpuEmulator())`),
so the real adapter code runs end to end on CPU tensors. They never call
`glm5_hal.reference`: an emulator that shared code with the judge would prove nothing.
"""
