"""libcst machinery: locating scopes and anchors, applying patches, absolutizing imports, pruning."""
