"""The config machinery every entry point shares (the trainer, the RL job, the planner): YAML read with line numbers
(``yaml_file``), dotted command-line overrides (``overrides``), size caps (``shape``), typed frozen sections built with
every error at once (``sections``, ``errors``), and the sections all jobs have in common (``common``). A job's config
module only declares its own sections and cross-section checks. Nothing here imports torch or another runtime layer.
"""
