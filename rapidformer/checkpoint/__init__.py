"""The one owner of checkpoints and run directories.

    state.py     what a checkpoint records (state.json): typed, versioned, older formats read
    store.py     the files: written into a temporary directory, sealed by a manifest of every
                 file's sha256, verified before a load, listed, pruned; the best marker
    protocol.py  the same across a job's ranks: who writes what, a failed write on any rank
                 ending the save on all, which checkpoint a resume loads
    resume.py    resume after a change: the plan, or one refusal naming what changed
    run_dir.py   a run directory's marker (written by rapidformer alone), its lock, and what
                 trainer.overwrite may remove

Strategies keep only their shard writers (`Strategy.save`/`load`); the engine hands them the
directory and records the rest.
"""
