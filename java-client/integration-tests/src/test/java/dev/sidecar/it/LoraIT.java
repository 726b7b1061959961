package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.spring.SidecarAutoConfiguration;
import dev.sidecar.spring.SidecarChatModel;
import dev.sidecar.spring.SidecarChatOptions;
import dev.sidecar.v1.ModelInfo;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Base64;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.boot.autoconfigure.AutoConfigurations;
import org.springframework.boot.test.context.runner.ApplicationContextRunner;

/**
 * A LoRA adapter served by the real sidecar ({@code --lora support=DIR}) and picked by
 * {@code SidecarChatOptions.model("support")}: ChatClient gets the adapter's answer, the base model's
 * without it, and the adapter is listed by GetModelInfo. The adapter is written for the demo model by
 * {@code src/test/python/make_lora_adapter.py}, which also prints both answers as the offline engine
 * gives them.
 */
class LoraIT {

    private static final String QUESTION = "What is a sidecar?";
    private static final int MAX_TOKENS = 6;

    private static Path dir;
    private static SidecarProcess sidecar;
    private static Map<String, String> expected;

    @BeforeAll
    static void start() throws Exception {
        dir = Files.createTempDirectory("sidecar-lora-it-");
        expected = makeAdapter(dir.resolve("support"));
        sidecar = SidecarProcess.start("--num-kv-blocks", String.valueOf(ItArgs.NUM_KV_BLOCKS),
                "--lora", "support=" + dir.resolve("support"), "--max-lora-rank", "8");
    }

    @AfterAll
    static void stop() throws Exception {
        if (sidecar != null) {
            sidecar.close();
        }
    }

    private static Map<String, String> makeAdapter(Path out) throws IOException, InterruptedException {
        String repoProp = System.getProperty("sidecar.repo");
        Path repo = Path.of(repoProp == null || repoProp.isBlank() ? "../.." : repoProp).toAbsolutePath().normalize();
        Path script = repo.resolve("java-client/integration-tests/src/test/python/make_lora_adapter.py");
        Path log = Files.createTempFile("lora-adapter-", ".log");
        ProcessBuilder pb = new ProcessBuilder(System.getProperty("sidecar.python"), script.toString(),
                out.toString(), QUESTION, String.valueOf(MAX_TOKENS)).directory(repo.toFile())
                .redirectErrorStream(true).redirectOutput(log.toFile());
        pb.environment().put("PYTHONPATH", repo.toString()); // the repository's package, as `-m sidecar` gets it
        Process p = pb.start();
        if (!p.waitFor(300, TimeUnit.SECONDS) || p.exitValue() != 0) {
            p.destroyForcibly();
            throw new IllegalStateException("make_lora_adapter.py failed:\n" + Files.readString(log));
        }
        Map<String, String> answers = new HashMap<>();
        for (String line : Files.readAllLines(log, StandardCharsets.UTF_8)) {
            int eq = line.indexOf('=');
            if (line.startsWith("base=") || line.startsWith("support=")) {
                answers.put(line.substring(0, eq),
                        new String(Base64.getDecoder().decode(line.substring(eq + 1)), StandardCharsets.UTF_8));
            }
        }
        assertThat(answers).containsKeys("base", "support");
        return answers;
    }

    private ApplicationContextRunner runner() {
        return new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + sidecar.grpcTarget(),
                        "sidecar.client.chat.max-tokens=" + MAX_TOKENS, "sidecar.client.chat.temperature=0");
    }

    @Test
    void chatClientWithTheAdaptersModelNameIsAnsweredByTheAdapter() {
        assertThat(expected.get("support")).isNotEqualTo(expected.get("base"));
        runner().run(ctx -> {
            SidecarChatModel model = ctx.getBean(SidecarChatModel.class);
            String viaAdapter = ChatClient.create(model).prompt()
                    .options(SidecarChatOptions.builder().model("support"))
                    .user(QUESTION).call().content();
            String viaBase = ChatClient.create(model).prompt().user(QUESTION).call().content();
            assertThat(viaAdapter).isEqualTo(expected.get("support"));
            assertThat(viaBase).isEqualTo(expected.get("base"));
        });
    }

    @Test
    void anUnknownAdapterIsRefusedNamingModel() {
        runner().run(ctx -> {
            SidecarChatModel model = ctx.getBean(SidecarChatModel.class);
            assertThatThrownBy(() -> ChatClient.create(model).prompt()
                    .options(SidecarChatOptions.builder().model("nope"))
                    .user(QUESTION).call().content())
                    .hasMessageContaining("model")
                    .hasMessageContaining("nope");
        });
    }

    @Test
    void getModelInfoListsTheAdapterWithItsBase() {
        try (var client = sidecar.client()) {
            ModelInfo info = client.modelInfo();
            assertThat(info.getLoraAdaptersList()).hasSize(1);
            assertThat(info.getLoraAdapters(0).getName()).isEqualTo("support");
            assertThat(info.getLoraAdapters(0).getBaseModel()).isEqualTo(info.getModel());
        }
    }
}
