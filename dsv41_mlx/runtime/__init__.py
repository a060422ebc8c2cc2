"""When the model's work reaches the device: the runner, the drafter's passes, residency."""
