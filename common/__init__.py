"""Small parts shared by the scripts: networks, environments, evaluation."""
