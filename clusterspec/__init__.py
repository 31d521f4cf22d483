"""Facts about the cluster that every part reads: inventory variables and GPU vendors.

Torch-free and light: rlmctl, the exporter, the trainer and the Ansible plugins import it.
"""
