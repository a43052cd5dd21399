"""Training data, one subpackage per modality (``text/``, ``vision/``, ``audio/``, ``dit/``) on the modules they all
share: the JSONL reader, the sample format, media paths, and the one order scheme every loader uses (``sampler.py``).
"""
