# Package of generated modeling files; written by `patchgen regen`.
