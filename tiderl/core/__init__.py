"""The pure core: policies and math shared by the simulator and the runtime.

Nothing in this package does I/O, imports torch, opens sockets or reads the wall clock;
time enters as an argument (``now``).
"""
