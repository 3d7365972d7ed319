"""The model runner: one batch per step, the forward (eager or compiled), sampling and logits processors."""
