"""The simulated engine's timing models: how long a forward pass would take on hardware
this machine does not have (`roofline`: a named accelerator and model, from data)."""
