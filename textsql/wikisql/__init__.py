"""WikiSQL itself: its format (format), its release files and hub copies (release), its official scoring (sql), and
generated data in its format (synthetic)."""
