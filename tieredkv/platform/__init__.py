"""The machine and the process: what the processor can do (CPU features) and how the C heap is tuned. Leaves: they
import nothing of the engine."""
