"""GLM-5.3-Flash modules built from megatron-core specs. Importing them changes nothing in megatron-core: the entry
points install this project's megatron-core changes (:func:`megatron_glm5.initialize.install_patches`)."""
