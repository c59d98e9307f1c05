"""The model: a forward's `context`, attention, MoE, the byte hourglass (`boundary`), the recurrent core, Engram memory, `CipherModel` (`lm`) and parameter `roles`.

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
