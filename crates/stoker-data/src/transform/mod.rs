//! Image transforms: JPEG decode, random-resized-crop, flip, normalize (owned by the transforms work).
