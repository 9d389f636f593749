// Names the GPT gives its scratch, shared by GptModel (which takes the scratch) and the call trace
// (which replays what it takes for a memory plan), so the two cannot disagree.
#pragma once

#include <string>

namespace mxddp {

// The global-memory-buffer name of a param's f32 weight copy: one per role ("w/layer.mlp.fc1.weight"
// for every layer's fc1), so layers take turns with the same storage; colwise: the copy of an MXFP8
// weight's column-wise payload that the data-gradient product reads ("w/<role>/col").
std::string gpt_weight_scratch_name(const std::string& param_name, bool colwise);

}  // namespace mxddp
