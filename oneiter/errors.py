"""Typed errors. Anything a user can cause raises `OneIterError`; the CLI prints it as one line and exits 2."""

__all__ = ["OneIterError", "FormatError", "DeviceError", "ModelError"]


class OneIterError(Exception):
    """A problem with the user's input (file, model, device, option). The message is one line, with the fix."""


class FormatError(OneIterError):
    """A file is missing, not HDF5, truncated, incomplete, or not a oneiter file."""


class DeviceError(OneIterError):
    """A device name is unknown, its vendor plugin is missing, or the device is not present."""


class ModelError(OneIterError):
    """A model spec cannot be loaded, or does not follow the model contract."""
