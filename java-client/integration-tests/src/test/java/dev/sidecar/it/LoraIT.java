package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.InvalidRequestException;
import dev.sidecar.client.PermissionDeniedException;
import dev.sidecar.client.SidecarClient;
import dev.sidecar.spring.SidecarAutoConfiguration;
import dev.sidecar.spring.SidecarChatModel;
import dev.sidecar.spring.SidecarChatOptions;
import dev.sidecar.v1.LoraAdapter;
import dev.sidecar.v1.ModelInfo;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
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
import org.springframework.context.ApplicationContext;

/**
 * A LoRA adapter served by the real sidecar ({@code --lora support=DIR}) and picked by
 * {@code SidecarChatOptions.model("support")}: ChatClient gets the adapter's answer, the base model's
 * without it, and the adapter is listed by GetModelInfo. The sidecar has tenant keys and an operator key
 * ({@code --admin-key}); the starter runs with the operator key, which also loads an adapter for one
 * tenant at run time (from under {@code --lora-root}) that a tenant key may not load. The adapter is
 * written for the demo model by {@code src/test/python/make_lora_adapter.py}, which also prints both
 * answers as the offline engine gives them.
 */
class LoraIT {

    private static final String QUESTION = "What is a sidecar?";
    private static final int MAX_TOKENS = 6;
    private static final String ADMIN_KEY = "it-operator-key";
    private static final String KEY_A = "it-key-a";
    private static final String KEY_B = "it-key-b";

    private static Path dir;
    private static SidecarProcess sidecar;
    private static Map<String, String> expected;

    @BeforeAll
    static void start() throws Exception {
        dir = Files.createTempDirectory("sidecar-lora-it-");
        expected = makeAdapter(dir.resolve("support"));
        sidecar = SidecarProcess.start("--num-kv-blocks", String.valueOf(ItArgs.NUM_KV_BLOCKS),
                "--lora", "support=" + dir.resolve("support"), "--max-lora-rank", "8",
                "--lora-root", dir.toString(), "--admin-key", ADMIN_KEY,
                "--api-key", KEY_A + ":team-a", "--api-key", KEY_B + ":team-b");
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
        return runner(ADMIN_KEY);
    }

    private ApplicationContextRunner runner(String apiKey) {
        return new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + sidecar.grpcTarget(),
                        "sidecar.client.api-key=" + apiKey,
                        "sidecar.client.chat.max-tokens=" + MAX_TOKENS, "sidecar.client.chat.temperature=0");
    }

    private static SidecarClient client(String apiKey) {
        return SidecarClient.builder().target(sidecar.grpcTarget()).apiKey(apiKey)
                .defaultDeadline(Duration.ofSeconds(60)).build();
    }

    private static String ask(ApplicationContext ctx, String model) {
        return ChatClient.create(ctx.getBean(SidecarChatModel.class)).prompt()
                .options(SidecarChatOptions.builder().model(model)).user(QUESTION).call().content();
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
        try (var client = client(ADMIN_KEY)) {
            ModelInfo info = client.modelInfo();
            assertThat(info.getLoraAdaptersList()).hasSize(1);
            assertThat(info.getLoraAdapters(0).getName()).isEqualTo("support");
            assertThat(info.getLoraAdapters(0).getBaseModel()).isEqualTo(info.getModel());
        }
    }

    @Test
    void anOperatorKeyLoadsAnAdapterForOneTenantThatATenantKeyMayNot() {
        String path = dir.resolve("support").toString();
        try (SidecarClient operator = client(ADMIN_KEY); SidecarClient tenant = client(KEY_A)) {
            assertThatThrownBy(() -> tenant.loadLoraAdapter("mine", path))
                    .isInstanceOf(PermissionDeniedException.class)
                    .hasMessageContaining("load_lora_adapter");
            assertThatThrownBy(() -> tenant.unloadLoraAdapter("support"))
                    .isInstanceOf(PermissionDeniedException.class)
                    .hasMessageContaining("unload_lora_adapter");
            assertThatThrownBy(() -> operator.loadLoraAdapter("elsewhere", "/etc"))
                    .isInstanceOf(InvalidRequestException.class)
                    .hasMessageContaining("--lora-root");
            assertThat(operator.loadLoraAdapter("support-a", path, "team-a").getStatus()).isEqualTo("loaded");
            try {
                assertThat(tenant.modelInfo().getLoraAdaptersList()).extracting(LoraAdapter::getName)
                        .containsExactly("support", "support-a");
                runner(KEY_A).run(ctx -> assertThat(ask(ctx, "support-a")).isEqualTo(expected.get("support")));
                runner(KEY_B).run(ctx -> assertThatThrownBy(() -> ask(ctx, "support-a"))
                        .hasMessageContaining("model")
                        .hasMessageContaining("support-a"));
            } finally {
                assertThat(operator.unloadLoraAdapter("support-a").getStatus()).isEqualTo("unloaded");
            }
            // The start-up adapter outlived the tenant's attempt to unload it.
            runner(KEY_B).run(ctx -> assertThat(ask(ctx, "support")).isEqualTo(expected.get("support")));
        }
    }
}
