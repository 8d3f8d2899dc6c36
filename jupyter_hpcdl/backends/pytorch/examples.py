"""The PyTorch side of the digits example (:mod:`jupyter_hpcdl.training.examples`): a small module with its own
optimizer and scheduler, as a user builds them; train it with ``loss="cross_entropy"``."""


def digits_torch_model(lr: float = 0.01):
    """A two-layer network for the 8×8 digits, Adam and a step schedule: ``(module, optimizer, scheduler)``."""
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
