"""The site's limits for the jobs a kernel submits (a session's new allocation, a batch run): the hub writes what
the user may ask for into their server's job (:data:`~..batchsystems.scheduler.OFFER_ENV`, the form's profile
narrowed for them, the job's own choices first), and a new job is checked against it by the form's own validator,
with its messages. Where a value is not given, the server's job's is taken (its partition, account and image); the
reservation is always the site's. The batch system's own limits (QOS, associations) still decide in the end."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..containers.kernelspec import DEFAULT_IMAGE
from ..spawner.options import OptionsError, validate_options
from ..spawner.profile import offer_profile
from .newjob import NewAllocation


@dataclass(frozen=True)
class Offered:
    """A new job as the site's limits take it."""

    alloc: NewAllocation  # with the partition, account and reservation filled in
    image_ref: str


def within_offer(alloc: NewAllocation, ranks: int, image_ref: str | None, offer: str | None,
                 user: str) -> Offered:
    """``alloc`` for ``ranks`` ranks (block-wise over its nodes) in ``image_ref``, checked against the job's
    ``offer`` (the JSON the hub wrote; empty: a server the hub did not start, nothing to check); no image: the
    offer's first (the server's). ValueError with
    the form's message and where the limits come from."""
    if not offer:
        return Offered(alloc, image_ref or DEFAULT_IMAGE)
    profile = offer_profile(offer)
    per_node = -(-ranks // max(alloc.nodes, 1))
    raw = {"partition": alloc.partition or "", "nodes": alloc.nodes, "walltime": alloc.walltime,
           "account": alloc.account or "", "gpus_per_node": alloc.gpus_per_rank * per_node or ""}
    if image_ref:
        named = [i.name for i in profile.images.values() if i.ref == image_ref]
        raw["image"] = named[0] if named else image_ref
    try:
        req = validate_options(raw, profile, user)
    except OptionsError as e:
        raise ValueError(f"{e} (the site's limits for your server's form hold for the jobs a kernel submits too)"
                         ) from None
    return Offered(replace(alloc, partition=req.partition, account=req.account, reservation=req.reservation),
                   req.image_ref)
