"""From a step graph to a bundle: textures and layouts, kernel emitters by table, the plan, the bundle
writer and its reports (memory, layout)."""
