#include "core/request.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace pagellm {
namespace {

TEST(Request, TokensAndState) {
  Request r("a", {1, 2, 3}, 5.0, 2, 42);
  EXPECT_EQ(r.request_id(), "a");
  EXPECT_EQ(r.num_prompt_tokens(), 3);
  EXPECT_EQ(r.num_output_tokens(), 0);
  EXPECT_EQ(r.status(), RequestStatus::WAITING);
  EXPECT_EQ(r.priority(), 2);
  EXPECT_EQ(r.extra_key(), 42u);
  EXPECT_DOUBLE_EQ(r.arrival_time(), 5.0);
  const int64_t out[] = {7, 8};
  r.append_output_tokens(out, 2);
  EXPECT_EQ(r.num_tokens(), 5);
  EXPECT_EQ(r.output_token_ids(), (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(r.prompt_token_ids(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r.all_token_ids(), (std::vector<int64_t>{1, 2, 3, 7, 8}));
  r.add_preemption();
  EXPECT_EQ(r.num_preemptions(), 1);
}

TEST(Request, EmptyPromptThrows) { EXPECT_THROW(Request("a", {}, 0.0), std::invalid_argument); }

TEST(Request, StatusHelpers) {
  EXPECT_FALSE(is_finished(RequestStatus::WAITING));
  EXPECT_FALSE(is_finished(RequestStatus::RUNNING));
  EXPECT_FALSE(is_finished(RequestStatus::PREEMPTED));
  EXPECT_TRUE(is_finished(RequestStatus::FINISHED_STOPPED));
  EXPECT_TRUE(is_finished(RequestStatus::FINISHED_LENGTH));
  EXPECT_TRUE(is_finished(RequestStatus::FINISHED_ABORTED));
  EXPECT_STREQ(to_string(RequestStatus::PREEMPTED), "PREEMPTED");
}

TEST(Request, CloneKeepsStateUnderNewId) {
  Request r("p", {1, 2}, 1.0, 3, 9);
  r.set_num_computed_tokens(2);
  r.set_status(RequestStatus::RUNNING);
  r.set_seq_handle(4);
  const Request c = r.clone_as("c");
  EXPECT_EQ(c.request_id(), "c");
  EXPECT_EQ(c.all_token_ids(), r.all_token_ids());
  EXPECT_EQ(c.num_computed_tokens(), 2);
  EXPECT_EQ(c.priority(), 3);
  EXPECT_EQ(c.seq_handle(), -1);
}

}  // namespace
}  // namespace pagellm
