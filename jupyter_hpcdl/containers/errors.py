"""Errors of the container layer. Each message says what is wrong and what to do about it."""


class ContainerError(Exception):
    """Base class: a container could not be prepared or run."""


class InvalidSpec(ContainerError, ValueError):
    """A value given for a container run is malformed (a name, a path, a variable)."""


class MountNotAllowed(ContainerError, PermissionError):
    """A bind mount names a host path outside what the site allows."""


class ModeNotSupported(ContainerError):
    """The asked execution mode cannot run on this host."""


class ToolsMissing(ContainerError, FileNotFoundError):
    """udocker or its engine tools (proot, ...) are not installed where they were looked for."""


class UnknownImage(ContainerError, LookupError):
    """The image is not in the user's udocker repository."""


class UdockerFailed(ContainerError):
    """A udocker command failed; the message carries its own words."""
