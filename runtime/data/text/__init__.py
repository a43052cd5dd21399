"""Text data: tokenizing text and chat samples (labels only on what the model should learn), packing them into rows
(truncating over-long ones), and the small English corpus the tests and demos train tokenizers and models on."""
