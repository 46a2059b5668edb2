"""OmegaConf resolvers the shipped configs use (registered once, on import)."""
from __future__ import annotations

import os

from omegaconf import OmegaConf


def slurm_master_addr() -> str:
    """The first host of this Slurm job (where rank 0's rendezvous listens); localhost outside
    a Slurm job (e.g. when a config is only shown or validated before submission)."""
    nodes = os.environ.get("SLURM_JOB_NODELIST")
    if not nodes:
        return "localhost"
    from submitit.slurm.slurm import _parse_node_list  # Slurm's compressed host-list syntax

    return _parse_node_list(nodes)[0]


if not OmegaConf.has_resolver("slurm_master_addr"):
    OmegaConf.register_new_resolver("slurm_master_addr", slurm_master_addr)
