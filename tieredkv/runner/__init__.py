"""The model runner: one batch per step and the forward over it (eager, the compiled decode graph, or the native
C step on CPU), far blocks staged in, the step's plan rebuilt on tensor-parallel ranks."""
